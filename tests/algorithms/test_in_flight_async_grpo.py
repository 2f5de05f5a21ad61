"""In-flight weight updates in asynchronous GRPO: the config rules, the capability check, the loop's engine
lifecycle (pause, refit, version, resume) against a fake engine that records the calls, and the arithmetic of the
metrics (age from the oldest span, mixed-version fraction, engine busy fraction) against independent
recomputations. Fakes only: the end-to-end run with vLLM is the lead's (issue 54)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from rlcore.algorithms.grpo import async_loop
from rlcore.algorithms.grpo.async_loop import (
    InFlight,
    busy_fraction,
    collect_young_enough,
    engine_metrics,
    mixed_version_fraction,
    oldest_versions,
)
from rlcore.algorithms.grpo.loop import _in_flight_problem
from rlcore.config import ConfigError, load_config, resolve
from rlcore.data import BatchedDataDict
from rlcore.plugins import Capability
from rlcore.run.rollouts import Rollout
from rlcore.run.step import Timer

EXAMPLE = "examples/grpo_async_tiny.yaml"
A = "grpo.async_grpo."


# -- config rules ------------------------------------------------------------------------------------------


def problems_of(*overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as err:
        load_config(EXAMPLE, list(overrides))
    return err.value.problems


def test_each_in_flight_setting_without_what_it_needs_is_refused_in_one_line():
    lines = problems_of(f"{A}enabled=false", f"{A}in_flight_weight_updates=true")
    assert lines == [
        f"{A}in_flight_weight_updates: is true, but refits land during generation only when generation runs ahead "
        f"of training; set {A}enabled=true or in_flight_weight_updates=false"
    ]
    lines = problems_of(f"{A}in_flight_pause_mode=abort")
    assert len(lines) == 1 and lines[0].startswith(f"{A}in_flight_pause_mode: is 'abort', but it is read only")
    assert f"set {A}in_flight_weight_updates=true" in lines[0]
    lines = problems_of(f"{A}recompute_kv_cache_after_weight_updates=true")
    assert len(lines) == 1 and lines[0].startswith(f"{A}recompute_kv_cache_after_weight_updates: is true, but")
    assert "without in-flight weight updates no request runs across a refit" in lines[0]
    lines = problems_of(
        f"{A}in_flight_weight_updates=true",
        f"{A}in_flight_pause_mode=abort",
        f"{A}recompute_kv_cache_after_weight_updates=true",
    )
    assert len(lines) == 1 and "with in_flight_pause_mode 'abort' no request keeps a cache" in lines[0]
    assert all("\n" not in line for line in lines)
    cfg = load_config(
        EXAMPLE, [f"{A}in_flight_weight_updates=true", f"{A}recompute_kv_cache_after_weight_updates=true"]
    )
    a = cfg.grpo.async_grpo
    assert (a.in_flight_weight_updates, a.recompute_kv_cache_after_weight_updates, a.in_flight_pause_mode) == (
        True,
        True,
        "keep",
    )


@dataclass
class FakeSpec:
    name: str
    capabilities: frozenset[Capability]

    def supports(self, capability: Capability) -> bool:
        return capability in self.capabilities


def test_in_flight_needs_an_engine_that_declares_the_capability():
    g = load_config(EXAMPLE, [f"{A}in_flight_weight_updates=true"]).grpo
    ahead = frozenset({Capability.ASYNC_GENERATION})
    without = SimpleNamespace(separate=True, spec=FakeSpec("eng", ahead))
    line = _in_flight_problem(g, without, async_generation=True)
    assert line == (
        f"{A}in_flight_weight_updates: is true, but the 'eng' generation backend does not declare "
        "'in_flight_weight_updates' (its refits wait for the requests running); set it to false"
    )
    able = SimpleNamespace(separate=True, spec=FakeSpec("eng", ahead | {Capability.IN_FLIGHT_WEIGHT_UPDATES}))
    assert _in_flight_problem(g, able, async_generation=True) is None
    off = load_config(EXAMPLE).grpo
    assert _in_flight_problem(off, without, async_generation=True) is None
    # A training backend that generates itself trains synchronously: nothing lands in flight, refused at resolve.
    cfg = load_config(
        EXAMPLE, ["policy.generation.backend=fsdp1", "policy.backend=fsdp1", f"{A}in_flight_weight_updates=true"]
    )
    with pytest.raises(ConfigError) as err:
        resolve(cfg, run=True)
    assert err.value.problems == [
        f"{A}in_flight_weight_updates: is true, but the 'fsdp1' training backend generates with its own weights, "
        "so no refit can land during generation; set it to false"
    ]


# -- the loop's engine lifecycle, against fakes ----------------------------------------------------------------

ROWS = 4  # samples per rollout
TOKENS = 6  # generated tokens per sample


@dataclass
class FakeEngine:
    """Records the lifecycle calls; ``version`` is what a token generated now would be tagged with."""

    continuous_serving: bool
    calls: list[tuple[Any, ...]] = field(default_factory=list)
    version: int = -1
    versions_set: dict[int, threading.Event] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    in_flight: set[int] = field(default_factory=set)  # rollouts started and not finished
    windows: list[tuple[float, float]] = field(default_factory=list)  # every rollout's generation window
    launched: dict[int, float] = field(default_factory=dict)  # step -> launch time, as the loop recorded it

    def landed(self, version: int) -> threading.Event:
        with self.lock:
            return self.versions_set.setdefault(version, threading.Event())

    def prepare_for_generation(self) -> bool:
        return True

    def pause_generation(self, mode: str = "wait", timeout_s: float | None = None) -> None:
        self.calls.append(("pause", mode, frozenset(self.in_flight)))

    def set_weight_version(self, version: int) -> None:
        self.calls.append(("set_weight_version", version))
        self.version = version

    def resume_generation(self, recompute_kv_cache: bool = False) -> None:
        self.calls.append(("resume", recompute_kv_cache))
        self.landed(self.version).set()


def fake_run(engine: FakeEngine, steps: int, overrides: list[str]) -> Any:
    cfg = load_config(EXAMPLE, ["policy.backend=reference", *overrides])
    train = SimpleNamespace(batch=lambda step: [f"prompt-{step}-{i}" for i in range(ROWS)], epoch_of=lambda step: 0)
    return SimpleNamespace(
        cfg=cfg,
        policy=object(),
        generation=engine,
        synchronizer=object(),
        data=SimpleNamespace(train=train),
        start_step=0,
        num_steps=steps,
        resumed_rollouts={},
        carried_rollouts=None,
    )


def rollout_of(first: list[int], last: list[int], begin: float, end: float) -> Rollout:
    """A rollout whose sample i generated its first half of tokens on ``first[i]``, the rest on ``last[i]``."""
    tags = torch.full((ROWS, 2 + TOKENS), -1, dtype=torch.long)  # 2 prompt positions
    for i in range(ROWS):
        tags[i, 2 : 2 + TOKENS // 2] = first[i]
        tags[i, 2 + TOKENS // 2 :] = last[i]
    data = BatchedDataDict(
        weight_version=torch.tensor(first, dtype=torch.long),
        generation_weight_versions=tags,
        generation_window=torch.tensor([[begin, end]] * ROWS, dtype=torch.float64),
        generation_lengths=torch.full((ROWS,), TOKENS, dtype=torch.long),
    )
    return Rollout(data, torch.zeros(ROWS), {})


def patch_loop(monkeypatch, engine: FakeEngine, keep_across_refit: bool) -> list[tuple[Any, ...]]:
    """Fake the step's collaborators inside async_loop. A rollout of step k >= 1 with ``keep_across_refit`` is
    still generating when the refit to v(k) happens and finishes only after it (as an engine that keeps its
    requests does); the loop deadlocks (here: fails after 10 s) if it waits for it before refitting."""
    trained: list[tuple[Any, ...]] = []

    def fake_refit(policy: Any, synchronizer: Any) -> float:
        engine.calls.append(("refit", frozenset(engine.in_flight)))
        return 1.0

    def fake_sample_and_score(run, timer, repeat, samples, *, ahead=False, greedy=False):
        step = int(samples[0].split("-")[1])
        with engine.lock:
            engine.in_flight.add(step)
        begin, start_version = time.time(), engine.version
        end_version = start_version
        if keep_across_refit and step >= 1:
            assert engine.landed(step).wait(10), f"rollout {step}: the refit to v({step}) never came"
            end_version = engine.version
        end = time.time()
        with engine.lock:
            engine.in_flight.discard(step)
            engine.windows.append((begin, end))
        return rollout_of([start_version] * ROWS, [end_version] * ROWS, begin, end)

    def fake_train(run, loss_fn, rollout, timer):
        trained.append(tuple(rollout.data["weight_version"].tolist()))
        return {"loss": 0.0}

    class RecordedInFlight(InFlight):
        def __init__(self, step: int, samples: list[Any], future: Future, launched_at: float) -> None:
            super().__init__(step, samples, future, launched_at)
            engine.launched[step] = launched_at

    monkeypatch.setattr(async_loop, "InFlight", RecordedInFlight)
    monkeypatch.setattr(async_loop, "refit", fake_refit)
    monkeypatch.setattr(async_loop, "sample_and_score", fake_sample_and_score)
    monkeypatch.setattr(async_loop, "train_on_rollout", fake_train)
    monkeypatch.setattr(async_loop, "validation_due", lambda run, step: False)
    monkeypatch.setattr(async_loop, "peak_memory_metrics", lambda policy, generation: {})
    return trained


def lifecycle(calls: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    return [c[:2] if c[0] in ("pause", "set_weight_version", "resume") else c[:1] for c in calls]


def test_in_flight_refits_pause_refit_version_resume_without_waiting_for_the_rollouts(monkeypatch):
    engine = FakeEngine(continuous_serving=True)
    patch_loop(monkeypatch, engine, keep_across_refit=True)
    run = fake_run(engine, 4, [f"{A}in_flight_weight_updates=true", f"{A}recompute_kv_cache_after_weight_updates=true"])
    rows: list[dict[str, float]] = []
    async_loop.async_grpo_train(run, None, lambda step, m: rows.append(m))

    expected = [
        c for v in range(4) for c in (("pause", "keep"), ("refit",), ("set_weight_version", v), ("resume", True))
    ]
    assert lifecycle(engine.calls) == expected  # refits to v0 (start) .. v3 (after step 2; none after the last)
    # Every refit after a step landed while the next rollout was still generating: nothing waited for it.
    refits = [c for c in engine.calls if c[0] == "refit"]
    assert [sorted(c[1]) for c in refits[1:]] == [[1], [2], [3]]
    assert [m["async/in_flight_refits"] for m in rows] == [1.0, 1.0, 1.0, 0.0]  # no refit after the last step
    # Rollout k >= 1 spans v(k-1) and v(k): mixed, and its age (oldest span) is exactly the limit.
    assert [m["async/mixed_version_samples_fraction"] for m in rows] == [0.0, 1.0, 1.0, 1.0]
    assert [m["async/age_max"] for m in rows] == [0.0, 1.0, 1.0, 1.0]
    assert all(m["async/regenerated_rollouts"] == 0.0 for m in rows)
    # Two rollouts (N + 1) generated at once: rollout 2 was launched while rollout 1 was still running.
    assert "async/engine_busy_fraction" not in rows[0]  # rollouts 0 and 1 were launched together
    # Rollout s + 1 is launched after the refit ending step s - 1: the busy fraction at step s covers [L(s), L(s+1)],
    # recomputed here on a grid from every window the fake engine produced (all of rollouts <= s by then).
    launched = engine.launched
    assert launched[0] == launched[1] < launched[2] < launched[3]
    for s in (1, 2):
        expected = covered_on_a_grid(engine.windows, launched[s], launched[s + 1])
        assert rows[s]["async/engine_busy_fraction"] == pytest.approx(expected, abs=1e-3)
    assert "async/engine_busy_fraction" not in rows[3]  # no rollout 4 is launched


def test_a_continuous_engine_without_in_flight_updates_drains_before_each_refit(monkeypatch):
    engine = FakeEngine(continuous_serving=True)
    patch_loop(monkeypatch, engine, keep_across_refit=False)
    rows: list[dict[str, float]] = []
    async_loop.async_grpo_train(fake_run(engine, 3, []), None, lambda step, m: rows.append(m))
    expected = [
        c for v in range(3) for c in (("pause", "wait"), ("refit",), ("set_weight_version", v), ("resume", False))
    ]
    assert lifecycle(engine.calls) == expected
    assert all("async/in_flight_refits" not in m for m in rows)
    assert [m["async/mixed_version_samples_fraction"] for m in rows] == [0.0, 0.0, 0.0]


def test_an_engine_that_runs_calls_in_order_keeps_the_one_step_off_path(monkeypatch):
    engine = FakeEngine(continuous_serving=False)
    patch_loop(monkeypatch, engine, keep_across_refit=False)
    async_loop.async_grpo_train(fake_run(engine, 3, []), None, lambda step, m: None)
    assert lifecycle(engine.calls) == [c for v in range(3) for c in (("refit",), ("set_weight_version", v))]
    with pytest.raises(ValueError, match=r"^grpo\.async_grpo\.in_flight_weight_updates: the generation engine does"):
        async_loop.async_grpo_train(
            fake_run(engine, 3, [f"{A}in_flight_weight_updates=true"]), None, lambda step, m: None
        )


# -- the metrics' arithmetic ---------------------------------------------------------------------------------


def covered_on_a_grid(windows: list[tuple[float, float]], start: float, end: float, n: int = 200_000) -> float:
    """Independent: the fraction of midpoints of ``n`` equal cells of [start, end] inside any window (float64)."""
    points = start + (np.arange(n, dtype=np.float64) + 0.5) * (end - start) / n
    inside = np.zeros(n, dtype=bool)
    for b, e in windows:
        inside |= (points >= b) & (points < e)
    return float(inside.mean())


def test_busy_fraction_is_the_union_of_the_windows_over_the_interval():
    windows = [(0.0, 2.0), (1.0, 3.0), (5.0, 6.0), (5.5, 5.7), (-1.0, 0.5), (9.0, 12.0), (13.0, 14.0)]
    # By hand: [0, 3] + [5, 6] + [9, 10] = 5 of 10 seconds.
    assert busy_fraction(windows, 0.0, 10.0) == pytest.approx(0.5, abs=1e-12)
    rng = np.random.default_rng(0)
    begins = rng.uniform(0.0, 100.0, 40)
    random_windows = [(float(b), float(b + d)) for b, d in zip(begins, rng.exponential(3.0, 40))]
    for start, end in [(0.0, 100.0), (17.3, 42.9), (95.0, 130.0)]:
        assert busy_fraction(random_windows, start, end) == pytest.approx(
            covered_on_a_grid(random_windows, start, end), abs=1e-4
        )


def test_the_busy_fraction_covers_one_launch_interval_and_drops_what_no_later_one_needs():
    windows = [(0.0, 4.0), (9.0, 12.0), (11.0, 15.0), (18.0, 25.0)]
    data = rollout_of([2] * ROWS, [2] * ROWS, 0.0, 1.0).data
    metrics = engine_metrics(data, windows, 10.0, 20.0)  # rollout 3 launched at 10, rollout 4 at 20
    # [10, 20]: [10, 15] + [18, 20] = 7 of 10 seconds.
    assert metrics["async/engine_busy_fraction"] == pytest.approx(0.7, abs=1e-12)
    assert metrics["async/mixed_version_samples_fraction"] == 0.0
    assert windows == [(18.0, 25.0)]
    assert "async/engine_busy_fraction" not in engine_metrics(data, windows, 1.0, 1.0)  # launched together
    assert "async/engine_busy_fraction" not in engine_metrics(data, windows, 30.0, None)  # the last rollout
    assert windows == [(18.0, 25.0)]  # nothing dropped without a next launch


def test_oldest_span_and_mixed_samples_come_from_the_token_tags():
    tags = torch.tensor(
        [
            [-1, -1, 3, 3, 4, -1],  # spans v3 and v4: mixed
            [-1, 5, 5, 5, 5, 5],  # one version
            [-1, -1, -1, -1, -1, -1],  # nothing generated: not mixed, its weight_version stands
            [-1, 2, 4, 6, -1, -1],  # three versions: mixed, oldest 2 though weight_version says 4
        ]
    )
    data = BatchedDataDict(weight_version=torch.tensor([3, 5, 1, 4]), generation_weight_versions=tags)
    assert oldest_versions(data).tolist() == [3, 5, 1, 2]
    assert mixed_version_fraction(data) == 0.5
    plain = BatchedDataDict(weight_version=torch.tensor([3, 5]))
    assert oldest_versions(plain).tolist() == [3, 5] and mixed_version_fraction(plain) is None


def test_a_rollout_whose_oldest_span_is_too_old_is_regenerated_and_its_windows_kept():
    done: Future = Future()
    done.set_result((rollout_of([4] * ROWS, [4] * ROWS, 1.0, 2.0), Timer()))
    stale = done.result()[0]
    stale.data["generation_weight_versions"][0, 2] = 1  # one token of sample 0 from v1: age 6 - 1 = 5 > 2
    fresh = rollout_of([5] * ROWS, [6] * ROWS, 3.0, 4.0)
    windows: list[tuple[float, float]] = []
    rollout, redone = collect_young_enough(
        InFlight(6, ["p"], done, 0.0), 6, 2, lambda samples: (fresh, Timer()), windows
    )
    assert redone == 1 and rollout is fresh
    assert sorted(set(windows)) == [(1.0, 2.0), (3.0, 4.0)]  # the discarded rollout's engine time counts too


def test_keeping_requests_across_an_adapter_refit_is_refused_and_the_other_modes_are_not() -> None:
    lora = ["policy.lora.enabled=true", "policy.lora.refit=adapter", f"{A}in_flight_weight_updates=true"]
    lines = problems_of(*lora)
    assert lines == [
        f"{A}in_flight_pause_mode: is 'keep' with policy.lora.refit 'adapter', but an adapter refit swaps the "
        "engine's LoRA adapter, and the requests kept across it would run on one it removed; set "
        f"{A}in_flight_pause_mode to abort or wait, or policy.lora.refit to merged"
    ]
    for mode in ("abort", "wait"):
        assert (
            load_config(EXAMPLE, [*lora, f"{A}in_flight_pause_mode={mode}"]).grpo.async_grpo.in_flight_pause_mode
            == mode
        )
    merged = load_config(EXAMPLE, [*lora[:1], "policy.lora.refit=merged", lora[2]])
    assert merged.grpo.async_grpo.in_flight_pause_mode == "keep"
