"""A restarted engine is stale until its next refit: :class:`RestartingGeneration` refuses to generate on it.

The restart and its refit normally happen together (under the recovery's lock); these cases are the ones where
they come apart: the refit after a restart failed (an error that is no engine's death), or a caller reaches the
recovery between the two. Fake engines as in ``test_engine_recovery.py``; the real thing (a TP-2 vLLM engine
whose rank is SIGKILLed) is ``plugins/rl-vllm/tests/test_tp_engine_restart.py``.
"""

from __future__ import annotations

import pytest
from ray.exceptions import RayActorError

from rlcore.refit import RefitError
from rlcore.run import engine_recovery
from rlcore.run.engine_recovery import EnginesNotRefitError, RestartingGeneration, RestartingSynchronizer
from tests.run.test_engine_recovery import recovery


@pytest.fixture(autouse=True)
def placement_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_recovery, "lost_nodes", lambda cluster: [])


def _death(actor: object) -> Exception:
    error = RefitError("refit failed: worker vllm-rank0 (rank 0) died")
    error.__cause__ = RayActorError(actor_id=actor._actor_id.hex())  # type: ignore[attr-defined]
    return error


def test_engines_restarted_and_not_refit_refuse_to_generate_until_a_refit_lands() -> None:
    rec, log = recovery({})
    assert rec.recover(_death(rec.generation.worker_group.workers[0]))  # restarted, not refit yet
    gen = RestartingGeneration(rec)
    for call in (lambda: gen.generate("p"), lambda: gen.generate_async("p")):
        with pytest.raises(EnginesNotRefitError, match=r"not been refit since they were restarted \(restart 1 "):
            call()
    assert "generate" not in log, "a request reached engines that hold the checkpoint's weights"
    RestartingSynchronizer(rec).sync_weights()
    assert gen.generate("p") == "out(p)"


def test_a_refit_that_fails_after_a_restart_leaves_the_engines_refusing() -> None:
    """The refit after the restart fails with an error that is no death (a sender's, say): raised as it is,
    and the engines still refuse to generate, instead of serving the checkpoint's weights."""
    rec, log = recovery({"generate": 1})
    original_start = rec.start

    def start_with_a_failing_refit():  # type: ignore[no-untyped-def]
        generation, synchronizer = original_start()
        synchronizer.sync_weights = lambda: (_ for _ in ()).throw(RefitError("refit failed: bad bucket"))
        return generation, synchronizer

    rec.start = start_with_a_failing_refit
    gen = RestartingGeneration(rec)
    with pytest.raises(RefitError, match="bad bucket"):
        gen.generate("p")
    with pytest.raises(EnginesNotRefitError):
        gen.generate("p")
    assert log.count("generate") == 1 and rec.restarts == 1


def test_engines_never_restarted_generate_as_before() -> None:
    """The guard is the restart's: engines the run started generate without it (the run refits them first)."""
    rec, log = recovery({})
    assert RestartingGeneration(rec).generate("p") == "out(p)" and log == ["generate"]


def test_an_engine_found_dead_while_a_request_is_submitted_is_restarted() -> None:
    """Submitting may call the engines (vLLM's driver asks them whether the last refit landed): a death found
    there is recovered like one found at collect, instead of stopping an asynchronous run."""
    from tests.run.test_engine_recovery import AsyncEngines, async_recovery

    class DyingAtSubmit(AsyncEngines):
        def generate_async(self, data: object, greedy: bool = False) -> tuple[object, object]:
            self.log.append("submit")
            self.died("submit")
            return self, data

    rec, log = async_recovery({"submit": 1})
    rec.generation.__class__ = DyingAtSubmit  # the engines the run started; a restart's come from start()
    gen = RestartingGeneration(rec)
    assert gen.collect(gen.generate_async("p")) == "out(p)"
    assert log == ["submit", "shutdown", "start", "prepare", "offload", "refit", "onload", "submit", "collect"]
    assert rec.restarts == 1
