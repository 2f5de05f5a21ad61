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
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlcore.algorithms.grpo.step import train_on_rollout
from rlcore.algorithms.toolkit import Rollout, Timer, sample_and_score
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


def async_grpo_train(run: Run, loss_fn: Any, on_step: Callable[[int, dict[str, float]], None]) -> None:
    """Run steps ``run.start_step .. run.num_steps - 1`` with generation running ahead (see the module doc)."""
    cfg, policy, generation = run.cfg, run.policy, run.generation
    max_age = cfg.grpo.async_grpo.max_trajectory_age_steps
    last_step = run.num_steps - 1

    def roll_out(samples: list[Any]) -> tuple[Rollout, Timer]:  # on the rollout thread, in submission order
        timer = Timer()
        return sample_and_score(run, timer, cfg.grpo.num_generations_per_prompt, samples, ahead=True), timer

    def launch(step: int) -> InFlight:
        samples = run.data.train.batch(step)
        if step in run.resumed_rollouts:  # generated before the interruption, from weights older than the checkpoint's
            done: Future = Future()
            done.set_result((run.resumed_rollouts.pop(step), Timer()))
            return InFlight(step, samples, done)
        return InFlight(step, samples, rollouts.submit(roll_out, samples))

    def carried(saved_step: int) -> dict[int, Rollout]:
        """What a checkpoint after ``saved_step`` must hold: the rollouts in flight that were launched before the
        refit to its weights (waited for); the later ones are generated again, alike, from its weights."""
        return {item.step: item.future.result()[0] for item in queue if item.step <= saved_step + max_age}

    def generate_greedy(batch: Any) -> Any:  # queued behind the rollouts in flight, on the newest weights
        return generation.collect(generation.generate_async(batch, greedy=True))

    def update_weights(version: int) -> float:
        moved = refit(policy, run.synchronizer)
        generation.set_weight_version(version)
        return moved

    generation.prepare_for_generation()  # the engines have their own resources: awake for the whole run
    refit_bytes = update_weights(run.start_step)
    # One thread rolls out the launched steps in order (a multi-turn rollout submits a request per turn);
    # the engines run the requests in the order they arrive.
    rollouts = ThreadPoolExecutor(1, thread_name_prefix="rlcore-rollout")
    try:
        queue = deque(launch(s) for s in range(run.start_step, min(run.start_step + max_age, last_step) + 1))
        previous_end: float | None = None
        for step in range(run.start_step, last_step + 1):
            timer = Timer()
            started = time.perf_counter()
            with timer.phase("generation_wait"):  # training waits for data
                item = queue.popleft()
                rollout, regenerated = collect_young_enough(item, step, max_age, roll_out)
            ages = step - rollout.data["weight_version"]
            window = rollout.data["generation_window"]
            begin, end = float(window[:, 0].min()), float(window[:, 1].max())
            idle = max(0.0, begin - previous_end) if previous_end is not None else 0.0
            previous_end = end
            metrics = train_on_rollout(run, loss_fn, rollout, timer)
            validating = validation_due(run, step)
            if step < last_step or validating:
                with timer.phase("refit"):
                    refit_bytes += update_weights(step + 1)
                if step + max_age + 1 <= last_step:
                    queue.append(launch(step + max_age + 1))
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
                    **memory,
                },
            )
            run.carried_rollouts = None
            refit_bytes = 0.0
    finally:
        run.carried_rollouts = None
        rollouts.shutdown(wait=False, cancel_futures=True)


def collect_young_enough(
    item: InFlight, step: int, max_age: int, roll_out: Callable[[list[Any]], tuple[Rollout, Timer]]
) -> tuple[Rollout, int]:
    """The rollout of ``item`` (its environment time added to the step's), rolled out again on the current
    weights if any sample is older than ``max_age`` steps; returns it and how many times it was redone."""
    rollout, timer = item.future.result()
    regenerated = 0
    while int((step - rollout.data["weight_version"]).max()) > max_age:
        regenerated += 1
        rollout, timer = roll_out(item.samples)
    rollout.metrics["time/environment_s"] = timer.seconds.get("time/environment_s", 0.0)
    return rollout, regenerated


def age_metrics(ages: Any, max_age: int) -> dict[str, float]:
    """The staleness of a rollout: mean and max age in steps, and the fraction of samples of each age."""
    n = len(ages)
    return {
        "async/age_mean": float(ages.float().mean()),
        "async/age_max": float(ages.max()),
        **{f"async/age_{a}_fraction": float((ages == a).sum()) / n for a in range(max_age + 1)},
    }
