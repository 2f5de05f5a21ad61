"""Ready-first rollouts (:mod:`rlcore.run.group_rollouts`): with a backend that serves continuously, each sample group
is its own request, handled as it finishes. A threaded in-process engine serves the groups with different delays
(they finish out of order) and answers each row from its prompt and seed alone, so the whole-batch rollout of the
same samples is the independent reference. Also: per-token weight versions in the rollout, and
:class:`RestartingGeneration`'s ``as_completed`` and pause/resume across an engine restart (fake deaths, as in
tests/run/test_engine_recovery.py). The real vLLM async engine end to end is tested with rl-vllm."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from rlcore.data import BatchedDataDict
from rlcore.datasets import Sample
from rlcore.interfaces.environment import EnvironmentReturn
from rlcore.interfaces.generation import GenerationInterface
from rlcore.run import engine_recovery
from rlcore.run.engine_recovery import EngineRecovery, PendingGeneration, RestartingGeneration
from rlcore.run.rollouts import run_rollout
from rlcore.run.step import Timer
from tests.run.test_engine_recovery import Engines, Policy, Synchronizer
from tests.run.test_multi_turn import ByteTokenizer

DELAY_S = {"f": 0.0, "m": 0.12, "s": 0.3}  # by the prompt's first letter: fast, mid, slow


def _digest(*parts: Any) -> bytes:
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).digest()


class ServingEngine(GenerationInterface):
    """Continuous serving in a thread pool. Row r's completion: 1-4 letters and logprobs from a digest of its tokens
    and its sampling seed (nothing else), so the same request gives the same completion whatever shares the call.
    A request sleeps by its prompt's first letter (:data:`DELAY_S`). With ``refit_at``, the tokens of a completion
    from the ``refit_at``-th on come from version ``version + 1`` (a refit landed while it ran)."""

    def __init__(self, version: int = 0, refit_at: int | None = None) -> None:
        self.version, self.refit_at = version, refit_at
        self.pool = ThreadPoolExecutor(max_workers=8)
        self.events: list[tuple[str, str, int]] = []  # (submit | done, group letter, rows' tokens so far)
        self.requests: dict[int, tuple[list[int], Any]] = {}  # seed -> (tokens asked from, stop strings)
        self.lock = threading.Lock()

    def generate(self, data: Any, greedy: bool = False) -> Any:
        ids, lengths, seeds = data["input_ids"], data["input_lengths"], data["sampling_seeds"].tolist()
        stops = data.get("stop_strings") or [None] * len(seeds)
        rows = []
        for r, seed in enumerate(seeds):
            prompt = ids[r, : int(lengths[r])].tolist()
            with self.lock:
                self.requests[seed] = (prompt, stops[r])
            h = _digest(prompt, seed)
            count = 1 + h[0] % 4
            rows.append(
                (prompt, [3 + 97 + h[1 + k] % 26 for k in range(count)], [-(h[8 + k] + 1) / 64 for k in range(count)])
            )
        width = max(len(p) + len(c) for p, c, _ in rows)
        out = torch.zeros(len(rows), width, dtype=torch.long)
        logprobs = torch.zeros(len(rows), width)
        for r, (prompt, completion, lps) in enumerate(rows):
            out[r, : len(prompt) + len(completion)] = torch.tensor(prompt + completion)
            logprobs[r, len(prompt) : len(prompt) + len(completion)] = torch.tensor(lps)
        return BatchedDataDict(
            output_ids=out,
            logprobs=logprobs,
            generation_lengths=torch.tensor([len(c) for _, c, _ in rows]),
            unpadded_sequence_lengths=torch.tensor([len(p) + len(c) for p, c, _ in rows]),
            truncated=torch.zeros(len(rows), dtype=torch.bool),
        )

    @property
    def continuous_serving(self) -> bool:
        return True

    def generate_async(self, data: Any, greedy: bool = False) -> Future:
        group = ByteTokenizer().decode(data["input_ids"][0, 1:2].tolist())
        with self.lock:
            self.events.append(("submit", group, int(data["input_lengths"][0])))

        def serve() -> Any:
            begin = time.time()
            time.sleep(DELAY_S[group])
            out = self.generate(data)
            out["weight_version"] = torch.full((out.size,), self.version, dtype=torch.long)
            out["generation_window"] = torch.tensor([[begin, time.time()]] * out.size, dtype=torch.float64)
            if self.refit_at is not None:
                versions = torch.full_like(out["output_ids"], -1)
                for r in range(out.size):
                    start, count = int(data["input_lengths"][r]), int(out["generation_lengths"][r])
                    versions[r, start : start + count] = self.version
                    versions[r, start + self.refit_at : start + count] = self.version + 1
                out["generation_weight_versions"] = versions
            with self.lock:
                self.events.append(("done", group, int(data["input_lengths"][0])))
            return out

        return self.pool.submit(serve)

    def as_completed(self, handles: Sequence[Future], timeout_s: float | None = None) -> Iterator[tuple[int, Any]]:
        remaining = dict(enumerate(handles))
        while remaining:
            done, _ = wait(list(remaining.values()), timeout_s, FIRST_COMPLETED)
            if not done:
                raise TimeoutError("no request finished in time")
            for index in [i for i, f in remaining.items() if f in done]:
                yield index, remaining.pop(index).result()

    def prepare_for_generation(self, *args: Any, **kwargs: Any) -> bool:
        return True

    def finish_generation(self, *args: Any, **kwargs: Any) -> bool:
        return True


class LetterEnvironment:
    """Scores each sample on its own: reward from its last completion's letters, a named component (its length),
    an error for a completion with a 'q'; done at turn ``metadata['stop']`` or on a completion starting with a
    vowel; observation ``"ok<turn>"`` with stop strings. Records the group letter of each call."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def step(self, logs: list[list[dict[str, str]]], metadata: list[dict[str, Any]]) -> EnvironmentReturn:
        self.calls.append(metadata[0]["group"])
        text = [log[-1]["content"] for log in logs]
        turn = [m.get("turn", 0) + 1 for m in metadata]
        errors = ["a 'q' cannot be scored" if "q" in t else None for t in text]
        return EnvironmentReturn(
            [{"role": "environment", "content": f"ok{t}"} for t in turn],
            [{**m, "turn": t} for m, t in zip(metadata, turn)],
            [0.0 if e else sum(map(ord, x)) % 10 / 10 + t for x, t, e in zip(text, turn, errors)],
            [t == m["stop"] or x[:1] in "aeiou" for x, t, m in zip(text, turn, metadata)],
            next_stop_strings=[["!"]] * len(logs),
            errors=errors,
            reward_components={"length": [float(len(x)) for x in text]},
        )


def _cfg(max_turns: int, max_total: int = 40, max_input: int | None = 12) -> Any:
    return SimpleNamespace(
        algorithm_section=SimpleNamespace(max_rollout_turns=max_turns, seed=7),
        policy=SimpleNamespace(max_total_sequence_length=max_total, tokenizer=SimpleNamespace(chat_template_kwargs={})),
        data=SimpleNamespace(max_input_seq_length=max_input),
    )


def _samples() -> list[Sample]:
    """The slow group first in sample order; its prompt is long enough to be cut at max_input_seq_length 12."""
    prompts = {"s": "slow: tell me a long story", "f": "fast: hi", "m": "mid: hey"}
    return [
        Sample(10 + n, [{"role": "user", "content": p}], {"group": g, "stop": 3 - n})
        for n, (g, p) in enumerate(prompts.items())
    ]


@pytest.fixture(scope="module")
def engine() -> Iterator[ServingEngine]:
    serving = ServingEngine()
    yield serving
    serving.pool.shutdown(wait=True)


def _both_ways(engine: ServingEngine, cfg: Any, repeat: int = 4) -> tuple[Any, Any, LetterEnvironment]:
    batch = run_rollout(cfg, engine.generate, LetterEnvironment(), ByteTokenizer(), _samples(), repeat, Timer())
    batch_requests = dict(engine.requests)
    engine.requests.clear()
    env = LetterEnvironment()
    ready = run_rollout(cfg, engine.generate, env, ByteTokenizer(), _samples(), repeat, Timer(), generation=engine)
    assert engine.requests == batch_requests  # every row asked the same: tokens, stop strings, seed
    return batch, ready, env


def _assert_same_rollout(batch: Any, ready: Any) -> None:
    for key in batch.data:
        assert torch.equal(ready.data[key], batch.data[key]), key
    assert set(ready.data) - set(batch.data) == {"weight_version", "generation_window"}
    assert torch.equal(ready.rewards, batch.rewards)
    assert ready.metrics == {**batch.metrics, "weight_version": 0.0}


def test_single_turn_ready_first_is_the_batch_rollout_and_scores_groups_as_they_finish(engine: ServingEngine) -> None:
    engine.events.clear()
    batch, ready, env = _both_ways(engine, _cfg(1))
    _assert_same_rollout(batch, ready)
    assert env.calls == ["f", "m", "s"]  # by completion, while the rows stay in sample order (slow first)
    assert ready.data["prompt_cut"].tolist() == [True] * 4 + [False] * 8 and ready.metrics["cut_prompts"] == 1.0
    assert [g for kind, g, _ in engine.events if kind == "submit"] == ["s", "f", "m"]  # one request per group
    assert [g for kind, g, _ in engine.events if kind == "done"] == ["f", "m", "s"]


def test_multi_turn_ready_first_is_the_batch_rollout_and_a_fast_group_goes_on_while_a_slow_one_generates(
    engine: ServingEngine,
) -> None:
    engine.events.clear()
    batch, ready, env = _both_ways(engine, _cfg(3, max_total=16))
    _assert_same_rollout(batch, ready)
    turns = ready.data["token_mask"].diff(dim=1).eq(1).sum(dim=1) + 1  # completions per sample
    assert len(set(turns.tolist())) >= 2 and int(turns.max()) >= 2  # samples ended at different turns
    assert ready.data["truncated"].any() and ready.metrics["env/errors"] == batch.metrics["env/errors"]
    slow_done = engine.events.index(next(e for e in engine.events if e[:2] == ("done", "s")))
    fast_second = [i for i, e in enumerate(engine.events) if e[:2] == ("submit", "f")][1]
    assert fast_second < slow_done  # the fast group's next turn was asked while the slow group still generated
    assert env.calls[:2] == ["f", "f"] or env.calls[:3] == ["f", "m", "f"]


class GroupedServingEngine(ServingEngine):
    """:class:`ServingEngine` with ``generate_groups_async``: records the group letters of each call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[list[str]] = []

    def generate_groups_async(self, batches: Sequence[Any], greedy: bool = False) -> list[Future]:
        self.calls.append([ByteTokenizer().decode(b["input_ids"][0, 1:2].tolist()) for b in batches])
        return [self.generate_async(batch, greedy) for batch in batches]


def test_a_backend_taking_groups_together_gets_every_first_turn_in_one_call() -> None:
    """Multi-turn through ``generate_groups_async``: the same rollout as the whole-batch one; the three groups'
    first turns are one call, every request goes through it, and a fast group's next turn is still asked while
    the slow group generates."""
    engine = GroupedServingEngine()
    try:
        batch, ready, _ = _both_ways(engine, _cfg(3, max_total=16))
    finally:
        engine.pool.shutdown(wait=True)
    _assert_same_rollout(batch, ready)
    assert engine.calls[0] == ["s", "f", "m"] and len(engine.calls) > 1, engine.calls
    assert sum(len(call) for call in engine.calls) == sum(kind == "submit" for kind, _, _ in engine.events)
    slow_done = engine.events.index(next(e for e in engine.events if e[:2] == ("done", "s")))
    fast_second = [i for i, e in enumerate(engine.events) if e[:2] == ("submit", "f")][1]
    assert fast_second < slow_done  # still ready-first: the fast group went on while the slow one generated


def test_tokens_carry_the_weight_version_that_generated_them() -> None:
    engine = ServingEngine(version=3, refit_at=1)
    try:
        env = LetterEnvironment()
        rollout = run_rollout(
            _cfg(3, max_input=None), engine.generate, env, ByteTokenizer(), _samples(), 2, Timer(), generation=engine
        )
    finally:
        engine.pool.shutdown(wait=True)
    data = rollout.data
    versions, mask = data["generation_weight_versions"], data["token_mask"].bool()
    assert versions.shape == data["output_ids"].shape and versions.dtype == torch.long
    assert versions[~mask].eq(-1).all()  # prompt, observations, padding
    spans = 0
    for row in range(data.size):
        generated = mask[row].nonzero().flatten().tolist()
        runs = [[generated[0]]]
        for pos in generated[1:]:
            runs[-1].append(pos) if pos == runs[-1][-1] + 1 else runs.append([pos])
        for run in runs:  # each completion: its first token on version 3, the rest after the refit on 4
            assert versions[row, run].tolist() == [3] + [4] * (len(run) - 1)
        spans += versions[row, generated].unique().numel() == 2
    assert spans > 0 and data["weight_version"].tolist() == [3] * data.size  # the oldest span's version


# -- RestartingGeneration: as_completed and the lifecycle across a restart ------------------------------------


class ServingEngines(Engines):
    """Fake engines with the lifecycle: ``as_completed`` yields the handles last-first; ``deaths['generate']``
    dies at the second yield; ``deaths['resume']`` at a resume."""

    def generate_async(self, data: Any, greedy: bool = False) -> str:
        self.log.append(f"submit {data}")
        return str(data)

    def as_completed(self, handles: Sequence[str], timeout_s: float | None = None) -> Iterator[tuple[int, str]]:
        for n, index in enumerate(reversed(range(len(handles)))):
            if n == 1:
                self.died("generate")
            yield index, f"out({handles[index]})"

    def pause_generation(self, mode: str = "wait", timeout_s: float | None = None) -> None:
        self.log.append(f"pause {mode}")

    def resume_generation(self, recompute_kv_cache: bool = False) -> None:
        self.log.append("resume")
        self.died("resume")

    @property
    def continuous_serving(self) -> bool:
        return True


def _serving_recovery(deaths: dict[str, int]) -> tuple[EngineRecovery, list[str]]:
    log: list[str] = []

    def start() -> tuple[Engines, Synchronizer]:
        log.append("start")
        engines = ServingEngines(log, deaths)
        return engines, Synchronizer(engines, "collective")

    generation, synchronizer = start()
    log.clear()
    return EngineRecovery(start, None, Policy(log), 1, generation, synchronizer, awake=True), log


@pytest.fixture
def placement_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_recovery, "lost_nodes", lambda cluster: [])


@pytest.mark.usefixtures("placement_alive")
def test_as_completed_redoes_on_new_engines_the_requests_a_death_lost() -> None:
    rec, log = _serving_recovery({"generate": 1})
    gen = RestartingGeneration(rec)
    assert gen.continuous_serving
    handles = [gen.generate_async(x) for x in "abc"]
    got = list(gen.as_completed(handles))
    assert got[0] == (2, "out(c)")  # the first done, yielded before the death
    assert sorted(got) == [(0, "out(a)"), (1, "out(b)"), (2, "out(c)")] and rec.restarts == 1
    restart = ["shutdown", "start", "prepare", "offload", "refit", "onload"]
    assert log == ["submit a", "submit b", "submit c", *restart, "submit a", "submit b"]  # c is not asked again


@pytest.mark.usefixtures("placement_alive")
def test_a_handle_of_engines_replaced_meanwhile_is_submitted_again_without_a_restart() -> None:
    rec, log = _serving_recovery({})
    gen = RestartingGeneration(rec)
    old = gen.generate_async("a")
    rec._restart(RuntimeError("the other thread's restart"))
    rec.unrefit = False
    log.clear()
    assert list(gen.as_completed([old])) == [(0, "out(a)")]
    assert log == ["submit a"] and rec.restarts == 1 and isinstance(old, PendingGeneration)


@pytest.mark.usefixtures("placement_alive")
def test_engines_restarted_while_paused_start_paused_and_the_resume_is_redone_on_them() -> None:
    rec, log = _serving_recovery({"resume": 1})
    gen = RestartingGeneration(rec)
    gen.pause_generation("keep")
    assert rec.paused == "keep"
    gen.resume_generation(recompute_kv_cache=True)
    restart = ["shutdown", "start", "prepare", "pause keep", "offload", "refit", "onload"]
    assert log == ["pause keep", "resume", *restart, "resume"] and rec.paused is None and rec.restarts == 1
