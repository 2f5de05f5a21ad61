"""Which engine deaths the run survives (:mod:`rlcore.run.engine_recovery`), without Ray: fake engines whose
calls die the way Ray reports a dead actor. The real thing, vLLM engines SIGKILLed in runs: mid-refit and
mid-generation in tests/algorithms/test_grpo.py's short run (colocated), mid-request in tests/run/test_multi_turn.py's
asynchronous run (engines on their own resources, refit by broadcast; found by the rollout thread)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from ray.exceptions import ActorDiedError, RayActorError

from rlcore.distributed import WorkerError
from rlcore.refit import RefitError
from rlcore.run import engine_recovery
from rlcore.run.engine_recovery import EngineRecovery, RestartingGeneration, RestartingSynchronizer
from rlcore.run.errors import RunError

_ids = itertools.count()


class Actor:
    def __init__(self) -> None:
        self._actor_id = bytes([next(_ids)])  # .hex() as a Ray actor id has it


class Engines:
    """A generation driver with ``worker_group.workers``; ``deaths`` of its calls die (an actor's death)."""

    def __init__(self, log: list[str], deaths: dict[str, int]) -> None:
        self.worker_group = type("Group", (), {"workers": [Actor(), Actor()]})()
        self.log, self.deaths = log, deaths

    def died(self, what: str) -> None:
        if self.deaths.get(what, 0) > 0:
            self.deaths[what] -= 1
            dead = RayActorError(actor_id=self.worker_group.workers[0]._actor_id.hex())
            raise WorkerError("worker vllm-rank0 (rank 0) died on node 10.0.0.1 (abcd1234): killed") from dead

    def generate(self, data: Any, greedy: bool = False) -> str:
        self.log.append("generate")
        self.died("generate")
        return f"out({data})"

    def prepare_for_generation(self) -> bool:
        self.log.append("prepare")
        return True

    def finish_generation(self) -> bool:
        self.log.append("finish")
        return True

    def shutdown(self) -> bool:
        self.log.append("shutdown")
        return True


class Synchronizer:
    def __init__(self, engines: Engines, transport: str = "shared_memory") -> None:
        self.engines, self.transport, self.stale = engines, transport, True

    def sync_weights(self) -> dict[str, float]:
        self.engines.log.append("refit")
        try:
            self.engines.died("refit")
        except WorkerError as exc:
            raise RefitError(f"refit failed: {exc}") from exc.__cause__
        self.stale = False
        return {"bytes": 8.0, "seconds": 0.0}

    def shutdown(self) -> None:
        pass


class Policy:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def offload_before_refit(self) -> None:
        self.log.append("offload")

    def offload_after_refit(self) -> None:
        self.log.append("onload")


def recovery(
    deaths: dict[str, int], restarts_per_step: int = 1, transport: str = "shared_memory", start_fails: bool = False
) -> tuple[EngineRecovery, list[str]]:
    """A recovery over fake engines whose calls die ``deaths`` times in all (each restart's engines share the
    count: a death after a restart is the new engines')."""
    log: list[str] = []

    def start() -> tuple[Engines, Synchronizer]:
        log.append("start")
        if start_fails:
            raise WorkerError("worker vllm-rank0 (rank 0) failed to start: RuntimeError: no memory")
        engines = Engines(log, deaths)
        return engines, Synchronizer(engines, transport)

    generation, synchronizer = start()
    log.clear()
    return EngineRecovery(start, None, Policy(log), restarts_per_step, generation, synchronizer), log


@pytest.fixture(autouse=True)
def placement_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_recovery, "lost_nodes", lambda cluster: [])


def test_a_generation_an_engine_death_lost_is_redone_on_restarted_refit_engines() -> None:
    rec, log = recovery({"generate": 1})
    assert RestartingGeneration(rec).generate("prompts") == "out(prompts)"
    # the dead engines stopped, new ones started on the same placement, the current weights refit, woken, redone
    assert log == ["generate", "shutdown", "start", "offload", "refit", "onload", "prepare", "generate"]
    assert not rec.synchronizer.stale and rec.restarts == 1
    assert rec.end_step() == {"engine/restarts": 1.0}
    assert rec.end_step() == {"engine/restarts": 1.0}  # cumulative over the run


def test_a_refit_an_engine_death_broke_is_done_again_into_new_engines() -> None:
    rec, log = recovery({"refit": 1})
    sync = RestartingSynchronizer(rec)
    assert sync.stale and sync.sync_weights()["bytes"] == 8.0 and not sync.stale
    assert log == ["refit", "shutdown", "start", "refit"] and rec.restarts == 1
    sync.stale = True  # what the loop sets after training reaches the current synchronizer
    assert rec.synchronizer.stale and sync.transport == "shared_memory"


def test_a_second_death_in_the_step_stops_the_run_in_one_line() -> None:
    rec, log = recovery({"generate": 2})
    with pytest.raises(RunError) as caught:
        RestartingGeneration(rec).generate("prompts")
    line = str(caught.value)
    assert "\n" not in line and line.startswith("worker vllm-rank0 (rank 0) died on node 10.0.0.1")
    assert line.endswith(
        "not restarted: it died again after 1 restart(s) in this step (policy.generation.engine_restarts_per_step=1)"
    )
    assert rec.restarts == 1


def test_the_allowance_is_per_step() -> None:
    deaths = {"generate": 1}
    rec, _ = recovery(deaths)
    gen = RestartingGeneration(rec)
    gen.generate("a")
    rec.end_step()
    deaths["generate"] = 1
    gen.generate("b")  # the next step's death: restarted again
    assert rec.end_step() == {"engine/restarts": 2.0}


def test_a_death_during_the_refit_after_a_restart_counts_for_the_step() -> None:
    rec, log = recovery({"generate": 1, "refit": 1})
    with pytest.raises(RunError, match=r"^RefitError: refit failed: worker vllm-rank0 .* died again after 1 restart"):
        RestartingGeneration(rec).generate("prompts")


def test_no_restarts_allowed_is_the_error_as_it_was() -> None:
    rec, log = recovery({"generate": 1}, restarts_per_step=0)
    with pytest.raises(WorkerError) as caught:
        RestartingGeneration(rec).generate("prompts")
    assert str(caught.value) == "worker vllm-rank0 (rank 0) died on node 10.0.0.1 (abcd1234): killed"
    assert log == ["generate"] and rec.restarts == 0


def test_a_training_rank_death_is_not_an_engine_s() -> None:
    rec, log = recovery({})
    rank_died = RefitError("refit failed: worker lm_policy-rank0 (rank 0) died on node x: killed")
    rank_died.__cause__ = ActorDiedError()  # no id of an engine

    def broken() -> None:
        raise rank_died

    rec.synchronizer.sync_weights = broken
    with pytest.raises(RefitError) as caught:
        RestartingSynchronizer(rec).sync_weights()
    assert caught.value is rank_died and log == [] and rec.restarts == 0
    other = RayActorError(actor_id="ffff")  # an actor that is no engine (a teacher rank, say)
    rec.synchronizer.sync_weights = lambda: (_ for _ in ()).throw(other)
    with pytest.raises(RayActorError):
        RestartingSynchronizer(rec).sync_weights()


def test_an_error_that_is_no_death_is_raised_as_it_is() -> None:
    rec, log = recovery({})
    rec.generation.generate = lambda data, greedy=False: (_ for _ in ()).throw(ValueError("prompt too long"))
    with pytest.raises(ValueError, match="prompt too long"):
        RestartingGeneration(rec).generate("prompts")
    assert rec.restarts == 0


def test_a_placement_that_is_gone_is_not_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_recovery, "lost_nodes", lambda cluster: ["bundle 0 on node 10.0.0.1 (abcd1234)"])
    rec, log = recovery({"generate": 1})
    with pytest.raises(
        RunError,
        match=r"killed; not restarted: its placement cannot be restored "
        r"\(bundle 0 on node 10\.0\.0\.1 \(abcd1234\) is gone\)$",
    ):
        RestartingGeneration(rec).generate("prompts")
    assert "start" not in log


def test_engines_refit_by_broadcast_are_restarted_into_a_new_refit_group() -> None:
    """Engines on their own resources: the new synchronizer makes a new refit group (joined on its first refit)."""
    rec, log = recovery({"generate": 1}, transport="collective")
    assert RestartingGeneration(rec).generate("prompts") == "out(prompts)"
    assert log == ["generate", "shutdown", "start", "offload", "refit", "onload", "prepare", "generate"]
    assert rec.restarts == 1 and rec.synchronizer.transport == "collective"


class AsyncEngines(Engines):
    """Engines with ``generate_async``/``collect`` (asynchronous GRPO's calls): a handle dies at collect."""

    def generate_async(self, data: Any, greedy: bool = False) -> tuple[Any, Any]:
        self.log.append("submit")
        return self, data

    def collect(self, handle: tuple[Any, Any]) -> str:
        engines, data = handle
        self.log.append("collect")
        engines.died("generate")
        return f"out({data})"

    def set_weight_version(self, version: int) -> None:
        self.log.append(f"version {version}")
        self.died("version")


def async_recovery(deaths: dict[str, int]) -> tuple[EngineRecovery, list[str]]:
    log: list[str] = []

    def start() -> tuple[Engines, Synchronizer]:
        log.append("start")
        engines = AsyncEngines(log, deaths)
        return engines, Synchronizer(engines, "collective")

    generation, synchronizer = start()
    log.clear()
    return EngineRecovery(start, None, Policy(log), 1, generation, synchronizer, awake=True), log


def test_an_asynchronous_request_lost_with_its_engine_is_submitted_again_to_woken_refit_engines() -> None:
    rec, log = async_recovery({"generate": 1})
    gen = RestartingGeneration(rec)
    assert gen.collect(gen.generate_async("prompts")) == "out(prompts)"
    # awake engines: woken as they start (no sleep between steps), refit, then the request submitted again
    assert log == [
        "submit",
        "collect",
        "shutdown",
        "start",
        "prepare",
        "offload",
        "refit",
        "onload",
        "submit",
        "collect",
    ]
    assert rec.restarts == 1


def test_a_request_the_other_thread_s_restart_broke_is_redone_without_counting_a_death() -> None:
    """The rollout thread's request was on the old engines when the main thread's refit found them dead and
    restarted them: collecting it fails, and it is submitted again to the new engines, no second restart."""
    deaths = {"refit": 1}
    rec, log = async_recovery(deaths)
    gen, sync = RestartingGeneration(rec), RestartingSynchronizer(rec)
    pending = gen.generate_async("prompts")  # on the first engines
    sync.sync_weights()  # the main thread: the refit finds them dead; restarted, refit again
    deaths["generate"] = 1  # the old engines are gone: the request in flight dies at collect
    assert gen.collect(pending) == "out(prompts)"
    assert rec.restarts == 1 and log.count("start") == 1
    assert log[-2:] == ["submit", "collect"]
    assert rec.end_step() == {"engine/restarts": 1.0}


def test_a_weight_version_an_engine_death_lost_is_published_again() -> None:
    rec, log = async_recovery({"version": 1})
    RestartingGeneration(rec).set_weight_version(3)
    assert log == ["version 3", "shutdown", "start", "prepare", "offload", "refit", "onload", "version 3"]


def test_restarts_from_two_threads_are_serialised() -> None:
    """The rollout thread collects while the main thread refits; the lock keeps a restart and its refit whole."""
    import threading

    rec, log = async_recovery({"generate": 1})
    gen, sync = RestartingGeneration(rec), RestartingSynchronizer(rec)
    results: list[str] = []
    rollout = threading.Thread(target=lambda: results.append(gen.collect(gen.generate_async("p"))))
    rollout.start()
    sync.sync_weights()
    rollout.join(timeout=10)
    assert results == ["out(p)"] and rec.restarts == 1
    restart = log.index("start")  # nothing of the other thread between a restart and its refit
    assert log[restart : restart + 5] == ["start", "prepare", "offload", "refit", "onload"]


def test_a_restart_that_fails_names_both_errors() -> None:
    rec, _ = recovery({"generate": 1})
    rec.start = lambda: (_ for _ in ()).throw(WorkerError("worker vllm-rank0 (rank 0) failed to start: OOM"))
    with pytest.raises(
        RunError,
        match=r"killed; restarting the engines failed: worker vllm-rank0 \(rank 0\) "
        r"failed to start: OOM$",
    ):
        RestartingGeneration(rec).generate("prompts")


def test_everything_else_reaches_the_current_engines() -> None:
    rec, _ = recovery({"generate": 1})
    gen = RestartingGeneration(rec)
    gen.generate("x")
    assert gen.worker_group is rec.generation.worker_group and gen.finish_generation()


@pytest.mark.parametrize(
    "value, problem", [("-1", "expected a value >= 0, got -1"), ("101", "expected a value <= 100, got 101")]
)
def test_the_setting_s_range_is_one_line_naming_it(value: str, problem: str) -> None:
    from rlcore.config import load_config

    with pytest.raises(Exception) as caught:
        load_config("examples/grpo_tiny.yaml", [f"policy.generation.engine_restarts_per_step={value}"])
    assert f"policy.generation.engine_restarts_per_step: {problem}" in str(caught.value).splitlines()


def test_the_setting_reaches_the_run() -> None:
    from rlcore.config import load_config

    cfg = load_config("examples/grpo_tiny.yaml", ["policy.generation.engine_restarts_per_step=3"])
    assert cfg.policy.generation.engine_restarts_per_step == 3


def test_a_restart_count_is_accepted_for_engines_on_their_own_resources() -> None:
    """Such engines are restarted too (into a new refit group), so the setting means the same there."""
    from rlcore.config import load_config

    own = ["policy.generation.colocated={enabled: false, resources: {num_nodes: 1, workers_per_node: 1}}"]
    assert load_config("examples/grpo_tiny.yaml", own).policy.generation.engine_restarts_per_step == 1
    cfg = load_config("examples/grpo_tiny.yaml", [*own, "policy.generation.engine_restarts_per_step=2"])
    assert cfg.policy.generation.engine_restarts_per_step == 2


def kill_an_engine_mid_refit_and_mid_generation(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """In a vLLM run started after this: SIGKILL engine 0 right after the run's first refit has started the
    engines' receivers (the training ranks then stream into a dead engine), and right after the first
    generation request is in the engines' hands. Returns the killed pids as they die. Used by
    tests/algorithms/test_grpo.py's short run (both deaths in step 0: restarted twice, so the run sets
    ``policy.generation.engine_restarts_per_step=2``)."""
    import os
    import signal

    from rl_vllm.generation import VllmGeneration

    killed: list[int] = []

    def killing_once(method: str) -> Any:
        original, done = getattr(VllmGeneration, method), []

        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            pid = None if done else self.worker_group.worker_pids()[0]
            out = original(self, *args, **kwargs)  # dispatched: the engines are receiving / generating
            if pid is not None:
                done.append(pid)
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            return out

        return call

    monkeypatch.setattr(VllmGeneration, "update_weights_via_ipc_zmq", killing_once("update_weights_via_ipc_zmq"))
    monkeypatch.setattr(VllmGeneration, "generate_async", killing_once("generate_async"))
    return killed


def kill_an_engine_mid_request(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """As :func:`kill_an_engine_mid_refit_and_mid_generation`, for asynchronous GRPO's engines (on their own
    resources, weights by collective broadcast): SIGKILL engine 0 right after the third request (the first
    rollout's third turn in a multi-turn run) is in the engines' hands. The rollout thread finds the death,
    restarts the engines and refits them into a new refit group while the main thread goes on. Returns the
    killed pid. Used by tests/run/test_multi_turn.py's asynchronous run."""
    import os
    import signal

    from rl_vllm.generation import VllmGeneration

    killed: list[int] = []
    original, calls = VllmGeneration.generate_async, []

    def generate_async(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        pid = self.worker_group.worker_pids()[0] if len(calls) == 3 else None
        out = original(self, *args, **kwargs)  # dispatched: the engines are generating
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        return out

    monkeypatch.setattr(VllmGeneration, "generate_async", generate_async)
    return killed
