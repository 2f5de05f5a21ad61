"""The lifecycle kit against in-process fakes: a conforming serving engine passes every check, and each faulty
one is caught by the check it breaks, within a bounded time (no Ray; a second or two in all)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from rlcore.data import BatchedDataDict
from rlcore.testing.conformance.lifecycle import (
    LIFECYCLE_CHECKS,
    LifecycleSubject,
    check_identity_refit,
    check_pause_abort,
    check_submit_during_drain,
    lifecycle_problems,
)
from rlcore.testing.conformance.lifecycle_fakes import (
    VOCAB,
    AbortReturnsPartial,
    FakeServingEngine,
    FakeStaleError,
    HangsDuringDrain,
    ShardedServingEngine,
    default_weights,
    fake_refit,
    sharded_fake_refit,
)

TIMEOUT_S = 1.0


def prompts() -> BatchedDataDict:
    ids = torch.tensor([[5, 9, 11, 0], [7, 3, 0, 0], [2, 4, 6, 8]])
    return BatchedDataDict(input_ids=ids, input_lengths=torch.tensor([3, 2, 4]))


def reference_completion(prompt: list[int], a: int, b: int, n: int) -> list[int]:
    """The toy recurrence, recomputed independently of the engine's loop."""
    seq = list(prompt)
    for _ in range(n):
        seq.append((a * seq[-1] + b * len(seq) + 3) % VOCAB + 2)
    return seq[len(prompt) :]


def subject_of(engine: FakeServingEngine, started: list[FakeServingEngine]) -> LifecycleSubject:
    def restart() -> FakeServingEngine:
        started.append(FakeServingEngine(stale=True))
        return started[-1]

    return LifecycleSubject(
        engine=engine,
        prompts=prompts(),
        weights=default_weights(),
        refit=fake_refit,
        restart=restart,
        verified_refit=True,
        in_flight_weight_updates=True,
        stale_errors=(FakeStaleError,),
        timeout_s=TIMEOUT_S,
        settle_s=0.02,
        paused_probe_s=0.05,
    )


@pytest.fixture
def started() -> Iterator[list[FakeServingEngine]]:
    engines: list[FakeServingEngine] = []
    yield engines
    for engine in engines:
        engine.shutdown()


def test_the_fake_generates_the_toy_recurrence(started: list[Any]) -> None:
    """The reference the checks compare with is right: greedy tokens equal an independent recomputation."""
    started.append(FakeServingEngine())
    out = started[0].generate(prompts(), greedy=True)
    for row, n in enumerate(prompts()["input_lengths"].tolist()):
        prompt = prompts()["input_ids"][row, :n].tolist()
        assert out["output_ids"][row, n : n + 24].tolist() == reference_completion(prompt, 3, 5, 24)


def test_a_conforming_engine_passes_every_check(started: list[Any]) -> None:
    started.append(FakeServingEngine())
    subject = subject_of(started[0], started)
    assert lifecycle_problems(subject) == []
    assert subject.engine is started[-1] and len(started) == 2, "the restart check replaced the engine"


def test_a_request_hung_during_a_drain_is_caught_in_bounded_time(started: list[Any]) -> None:
    started.append(HangsDuringDrain())
    subject = subject_of(started[0], started)
    begin = time.monotonic()
    problems = check_submit_during_drain(subject)
    elapsed = time.monotonic() - begin
    assert elapsed < TIMEOUT_S + 2.0, f"the hang took {elapsed:.1f} s to report"
    assert len(problems) == 1, problems
    assert problems[0].startswith("request submitted during a 'wait' drain: ")
    assert "the request submitted during the drain, after the resume was not done within 1 s (hung)" in problems[0]
    # every other check passes on it: the kit names only the broken promise
    others = [c for c in LIFECYCLE_CHECKS if c is not check_submit_during_drain]
    assert [p for check in others for p in check(subject)] == []


def test_an_abort_that_hands_back_partial_output_is_caught(started: list[Any]) -> None:
    started.append(AbortReturnsPartial())
    problems = check_pause_abort(subject_of(started[0], started))
    assert any("output was handed to its caller while paused" in p for p in problems), problems
    assert any("differ from the unpaused" in p and "partial" in p for p in problems), problems


def test_an_identity_refit_that_changes_the_weights_is_caught(started: list[Any]) -> None:
    """A loader that reloads the same weights but not bit for bit (vLLM #48284): outputs and fingerprints."""

    class PerturbingReload(FakeServingEngine):
        def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
            super().load_weights({k: v + 1.0 for k, v in state_dict.items()})

    started.append(PerturbingReload())
    problems = check_identity_refit(subject_of(started[0], started))
    assert any("after identity refit 1: greedy tokens differ" in p for p in problems), problems
    assert any("after identity refit 1:" in p and "holds fingerprint" in p for p in problems), problems


def test_identity_refit_on_tensor_parallel_ranks_compares_each_rank_with_its_slices(started: list[Any]) -> None:
    """Ranks that hold slices: compared with the whole tensors they fail; compared, rank by rank, with what the
    refit hook says it sent each (the slices), they pass; a rank whose loader corrupts its slice is named, though
    the greedy outputs (of the whole weights) are unchanged."""
    started.append(ShardedServingEngine())
    subject = subject_of(started[0], started)
    assert any("engine 0 holds fingerprint" in p and "'lm'" in p for p in check_identity_refit(subject))
    subject.refit = sharded_fake_refit
    assert check_identity_refit(subject) == []
    started.append(ShardedServingEngine(corrupt_rank=1))
    subject = subject_of(started[-1], started)
    subject.refit = sharded_fake_refit
    problems = check_identity_refit(subject)
    assert len(problems) == 2 and all("engine 1 holds fingerprint" in p and "'lm'" in p for p in problems), problems
