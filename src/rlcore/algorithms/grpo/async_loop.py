"""Asynchronous GRPO: the engines generate the next rollouts while the policy trains.

With ``grpo.async_grpo.max_trajectory_age_steps`` = N, the rollout trained at
step ``s`` may come from the weights of step ``s - N`` or later. Weights are
versioned by the training step that produces them (``v(s)``: the weights
step ``s`` trains). The schedule, for a run starting at step ``s0``::

    refit v(s0); launch the rollouts of steps s0 .. s0+N, all on v(s0)
    step s:  collect rollout s; train (-> v(s+1)); refit v(s+1); launch rollout s+N+1 on v(s+1)

so rollout ``s+N+1`` is generated while steps ``s+1 ..`` train, and is
trained at step ``s+N+1``, N steps after its weights. An engine runs requests
in submission order and finishes a request before it takes new weights, so it
tags every sample with the version of the last refit before the request; the
loop checks each rollout's age from those tags and regenerates one that is
too old (counted; it cannot happen with an engine that keeps the order).

A rollout thread runs the launched rollouts one after another. A multi-turn
rollout sends one request per turn, so a refit can land between two turns of
a sample: the sample's version is then the oldest of its turns' (its age is
never understated), and each turn's engine logprobs are those of the weights
that generated it, which is what the importance correction compares against.

An engine that serves requests continuously (its ``continuous_serving``: rl-vllm with
``vllm_cfg.async_engine``) takes no weights between calls of its own accord, so each refit is
``pause_generation(mode)``, refit, ``set_weight_version(s+1)``, ``resume_generation(recompute_kv_cache)``. Without
``grpo.async_grpo.in_flight_weight_updates`` the mode is ``wait`` (the running requests finish first: each sample
comes from one version, as above); with it, ``grpo.async_grpo.in_flight_pause_mode`` (``keep`` by default: the
requests running continue on the new weights, so a sample's tokens may span versions, and its age is that of its
oldest span). Either way the loop does not wait for the rollouts in flight before a refit, and up to N + 1
rollouts are generated at once (a rollout thread each), so the engine always has requests to run.

A resumed run discards the in-flight rollouts of the run it continues: it
starts the schedule again from the checkpoint's weights, so its first rollouts
are younger than the rule allows, never older.

One engine generation runs per training step, so a step takes about
``max(generation, training) + refit`` instead of their sum; a larger N does not
speed it up further, it only lets rollouts be older.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlcore.algorithms.grpo.step import train_on_rollout
from rlcore.algorithms.toolkit import Rollout, Timer, sample_and_score
from rlcore.interfaces.generation import serves_continuously
from rlcore.run.step import peak_memory_metrics, refit
from rlcore.run.validation import validate, validation_due

if TYPE_CHECKING:
    from rlcore.run.build import Run


@dataclass
class InFlight:
    """A rollout under way: its samples, and the future of ``(rollout, its timer)``."""

    step: int
    samples: list[Any]
    future: Future
    launched_at: float  # time.time(), the clock of the engines' generation windows


def async_grpo_train(run: Run, loss_fn: Any, on_step: Callable[[int, dict[str, float]], None]) -> None:
    """Run steps ``run.start_step .. run.num_steps - 1`` with generation running ahead (see the module doc)."""
    cfg, policy, generation = run.cfg, run.policy, run.generation
    settings = cfg.grpo.async_grpo
    max_age = settings.max_trajectory_age_steps
    last_step = run.num_steps - 1
    serving = serves_continuously(generation)
    in_flight = settings.in_flight_weight_updates
    if in_flight and not serving:
        raise ValueError(
            "grpo.async_grpo.in_flight_weight_updates: the generation engine does not serve requests continuously "
            "(its continuous_serving is false), so it cannot take weights while requests run; configure its "
            "asynchronous engine (rl-vllm: policy.generation.vllm_cfg.async_engine: true) or set it to false"
        )
    mode = settings.in_flight_pause_mode if in_flight else "wait"
    recompute = in_flight and settings.recompute_kv_cache_after_weight_updates

    def roll_out(samples: list[Any]) -> tuple[Rollout, Timer]:  # on the rollout thread, in submission order
        timer = Timer()
        return sample_and_score(run, timer, cfg.grpo.num_generations_per_prompt, samples, ahead=True), timer

    def launch(step: int, at: float | None = None) -> InFlight:
        samples, at = run.data.train.batch(step), time.time() if at is None else at
        if step in run.resumed_rollouts:  # generated before the interruption, from weights older than the checkpoint's
            done: Future = Future()
            done.set_result((run.resumed_rollouts.pop(step), Timer()))
            return InFlight(step, samples, done, at)
        return InFlight(step, samples, rollouts.submit(roll_out, samples), at)

    def carried(saved_step: int) -> dict[int, Rollout]:
        """What a checkpoint after ``saved_step`` must hold: the rollouts in flight that were launched before the
        refit to its weights (waited for); the later ones are generated again, alike, from its weights."""
        return {item.step: item.future.result()[0] for item in queue if item.step <= saved_step + max_age}

    def generate_greedy(batch: Any) -> Any:  # queued behind the rollouts in flight, on the newest weights
        return generation.collect(generation.generate_async(batch, greedy=True))

    def update_weights(version: int, timer: Timer | None = None) -> float:
        if not serving:  # the engines run calls in order: this refit lands after the requests submitted before it
            moved = refit(policy, run.synchronizer)
            generation.set_weight_version(version)
            return moved
        with timer.phase("refit_pause") if timer is not None else nullcontext():  # with "wait": the drain
            generation.pause_generation(mode)
        try:
            moved = refit(policy, run.synchronizer)
            generation.set_weight_version(version)  # while paused: every token after the resume carries it
        finally:
            generation.resume_generation(recompute_kv_cache=recompute)
        return moved

    generation.prepare_for_generation()  # the engines have their own resources: awake for the whole run
    refit_bytes = update_weights(run.start_step)
    # Without continuous serving one thread rolls out the launched steps in order (a multi-turn rollout submits a
    # request per turn) and the engines run the requests in the order they arrive; with it, every rollout in
    # flight (at most N + 1) has a thread, so the engines are never left without requests.
    rollouts = ThreadPoolExecutor(max_age + 1 if serving else 1, thread_name_prefix="rlcore-rollout")
    try:
        first = time.time()  # the first rollouts are launched together
        queue = deque(launch(s, first) for s in range(run.start_step, min(run.start_step + max_age, last_step) + 1))
        windows: list[tuple[float, float]] = []  # every collected sample's generation window, for the busy fraction
        previous_end: float | None = None
        for step in range(run.start_step, last_step + 1):
            timer = Timer()
            started = time.perf_counter()
            with timer.phase("generation_wait"):  # training waits for data
                item = queue.popleft()
                rollout, regenerated = collect_young_enough(item, step, max_age, roll_out, windows)
            ages = step - oldest_versions(rollout.data)
            window = rollout.data["generation_window"]
            begin, end = float(window[:, 0].min()), float(window[:, 1].max())
            idle = max(0.0, begin - previous_end) if previous_end is not None else 0.0
            previous_end = end
            metrics = train_on_rollout(run, loss_fn, rollout, timer)
            validating = validation_due(run, step)
            refit_in_flight = False
            if step < last_step or validating:
                refit_in_flight = any(not other.future.done() for other in queue)
                with timer.phase("refit"):
                    refit_bytes += update_weights(step + 1, timer)
                if step + max_age + 1 <= last_step:
                    queue.append(launch(step + max_age + 1))
            # this step's interval: from rollout ``step``'s launch to the next one's (queue[0] is rollout step + 1)
            engine = engine_metrics(rollout.data, windows, item.launched_at, queue[0].launched_at if queue else None)
            if in_flight:
                engine["async/in_flight_refits"] = float(refit_in_flight and mode != "wait")
            if validating:
                metrics.update(validate(run, generate_greedy))
            generated = float(rollout.data["generation_lengths"].sum())
            # The training ranks only: a call to an engine would queue behind the rollout it is generating.
            memory = peak_memory_metrics(policy, None)
            run.carried_rollouts = lambda step=step: carried(step)
            on_step(
                step,
                {
                    **metrics,
                    "epoch": float(run.data.train.epoch_of(step)),
                    "tokens_per_s": generated / max(end - begin, 1e-9),
                    "refit_bytes": refit_bytes,
                    **timer.seconds,
                    "time/step_s": time.perf_counter() - started,  # wall: waiting, training, refit, launch, validation
                    "time/generation_s": end - begin,  # on the engines, overlapped with earlier steps' training
                    "time/generation_idle_s": idle,  # how long the engines waited (for weights) before this rollout
                    **age_metrics(ages, max_age),
                    "async/regenerated_rollouts": float(regenerated),
                    **engine,
                    **memory,
                },
            )
            run.carried_rollouts = None
            refit_bytes = 0.0
    finally:
        run.carried_rollouts = None
        rollouts.shutdown(wait=False, cancel_futures=True)


def collect_young_enough(
    item: InFlight,
    step: int,
    max_age: int,
    roll_out: Callable[[list[Any]], tuple[Rollout, Timer]],
    windows: list[tuple[float, float]] | None = None,
) -> tuple[Rollout, int]:
    """The rollout of ``item`` (its environment time added to the step's), rolled out again on the current
    weights if any sample's oldest tokens are older than ``max_age`` steps; returns it and how many times it was
    redone. ``windows``: every generated sample's generation window is appended to it (a discarded one's too:
    the engines spent that time)."""
    rollout, timer = item.future.result()
    regenerated = 0
    while True:
        if windows is not None and "generation_window" in rollout.data:
            windows.extend((float(b), float(e)) for b, e in rollout.data["generation_window"].tolist())
        if int((step - oldest_versions(rollout.data)).max()) <= max_age:
            break
        regenerated += 1
        rollout, timer = roll_out(item.samples)
    rollout.metrics["time/environment_s"] = timer.seconds.get("time/environment_s", 0.0)
    return rollout, regenerated


def tagged_span_ends(tags: Any) -> tuple[Any, Any, Any]:
    """Of per-token version tags ``[B, T]`` (-1 where no token was generated): each row's oldest and newest tag,
    and whether it has any (``[B]`` each; the oldest and newest of a row without tags are meaningless)."""
    import torch

    tagged = tags >= 0
    oldest = tags.masked_fill(~tagged, torch.iinfo(tags.dtype).max).min(dim=1).values
    newest = tags.masked_fill(~tagged, -1).max(dim=1).values
    return oldest, newest, tagged.any(dim=1)


def oldest_versions(data: Any) -> Any:
    """``[B]``: the version of each sample's oldest weights, its ``weight_version``, or, where the engine tagged
    every token (``generation_weight_versions``, -1 where no token was generated), the oldest tag if older."""
    import torch

    oldest = data["weight_version"]
    if "generation_weight_versions" not in data:
        return oldest
    first, _, tagged = tagged_span_ends(data["generation_weight_versions"])
    return torch.where(tagged, torch.minimum(oldest, first), oldest)


def mixed_version_fraction(data: Any) -> float | None:
    """The fraction of samples whose generated tokens come from more than one weight version (None when the
    engine does not tag tokens: ``generation_weight_versions``)."""
    if "generation_weight_versions" not in data:
        return None
    oldest, newest, tagged = tagged_span_ends(data["generation_weight_versions"])
    return float((tagged & (newest != oldest)).float().mean())


def busy_fraction(windows: Iterable[tuple[float, float]], start: float, end: float) -> float:
    """The fraction of ``[start, end]`` (``end > start``) covered by the union of ``windows`` (``(begin, end)``
    intervals, overlapping or not)."""
    clipped = sorted((max(b, start), min(e, end)) for b, e in windows if e > start and b < end)
    covered, reach = 0.0, start
    for b, e in clipped:
        b = max(b, reach)
        if e > b:
            covered += e - b
            reach = e
    return covered / (end - start)


def engine_metrics(data: Any, windows: list[tuple[float, float]], start: float, end: float | None) -> dict[str, float]:
    """``async/mixed_version_samples_fraction`` of the rollout ``data`` of step ``s``, and
    ``async/engine_busy_fraction``: the fraction of the time from the launch of rollout ``s`` (``start``) to the
    launch of rollout ``s + 1`` (``end``; one step's wall time) during which the engines were generating (the
    union of the ``windows`` of every sample collected so far). Every sample generated in that time belongs to a
    rollout up to ``s``, all collected by now, so the fraction is exact; it is left out where that time is empty
    (the rollouts launched together at the start) or rollout ``s + 1`` is never launched (``end`` None). Windows
    no later interval needs are dropped."""
    metrics: dict[str, float] = {}
    if (mixed := mixed_version_fraction(data)) is not None:
        metrics["async/mixed_version_samples_fraction"] = mixed
    if end is not None:
        if end > start:
            metrics["async/engine_busy_fraction"] = busy_fraction(windows, start, end)
        windows[:] = [w for w in windows if w[1] > end]
    return metrics


def age_metrics(ages: Any, max_age: int) -> dict[str, float]:
    """The staleness of a rollout: mean and max age in steps, and the fraction of samples of each age."""
    n = len(ages)
    return {
        "async/age_mean": float(ages.float().mean()),
        "async/age_max": float(ages.max()),
        **{f"async/age_{a}_fraction": float((ages == a).sum()) / n for a in range(max_age + 1)},
    }
