"""The algorithm author's toolkit: what every rollout algorithm does in a step, written once (GRPO, on-policy
distillation and a third party's use it; docs/writing-an-algorithm.md shows it in use).

A rollout step keeps this order, because the engines and the policy share memory and weights:

1. refit the engines when the weights are stale (the policy trained since the engines last took its weights),
   so every completion of the step is sampled from the weights about to be trained;
2. prepare for generation (wake the engines; colocated ones take their memory back);
3. sample and score: draw prompts, generate, let the environment answer and score, over the turns;
4. finish generation (let the engines sleep, freeing memory for training);
5. whatever the algorithm computes from the rollout (advantages, logprob passes, a teacher's top-k);
6. prepare for training, train, finish training;
7. mark the weights stale, so the next step (or a validation) refits first.

:func:`generating` does 1, 2 and 4 around a block, :func:`sample_and_score` does 3 and :func:`train_step` does 6
and 7; :func:`step_metrics` is a step's row of metrics and :func:`train_rollout_steps` runs the steps (validation
when due, an early end when the data runs out). An engine that dies is restarted behind ``run.generation`` and
``run.synchronizer`` (a restart and every refit hold one lock), so an algorithm on these helpers gets that too.

:func:`train_step` takes a batch of whole global batches (``policy.train_global_batch_size`` rows each: that many
optimizer steps) or fewer rows than one global batch: one optimizer step on exactly those rows. The loss is
normalised by the valid sequences and tokens of the step's own rows, so an algorithm that keeps some of its rows
(rejection sampling) trains on the kept ones alone instead of masking the others, and pays only for them; the
update is the one the masked whole batch would give (masked rows count for nothing).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

from rlcore.run.rollout_loop import train_rollout_steps
from rlcore.run.rollouts import Rollout, run_rollout
from rlcore.run.step import Timer, peak_memory_metrics, refit, training_batch

if TYPE_CHECKING:
    from rlcore.data import BatchedDataDict
    from rlcore.interfaces.loss import LossFunction
    from rlcore.interfaces.run import RunContext


def refit_if_stale(run: RunContext, timer: Timer) -> float:
    """Step 1: move the policy's weights into the engines when they are stale (timed as ``refit``); returns the
    bytes moved (0 when nothing was refit)."""
    if run.synchronizer is None or not run.synchronizer.stale:
        return 0.0
    with timer.phase("refit"):
        return refit(run.policy, run.synchronizer)


@contextmanager
def generating(run: RunContext, timer: Timer) -> Iterator[float]:
    """Steps 1, 2 and 4 around the block: refit when stale, wake the engines, and after the block let them sleep
    (both timed as ``generation``). Yields the bytes the refit moved. An error inside the block leaves the
    engines awake: the run is ending, and its shutdown stops them."""
    if run.generation is None:
        raise ValueError("generating: this run has no generation backend (its algorithm's spec says generates=False)")
    moved = refit_if_stale(run, timer)
    with timer.phase("generation"):
        run.generation.prepare_for_generation()
    yield moved
    with timer.phase("generation"):
        run.generation.finish_generation()


def sample_and_score(
    run: RunContext,
    timer: Timer,
    repeat: int,
    samples: list[Any] | None = None,
    *,
    greedy: bool = False,
    ahead: bool = False,
) -> Rollout:
    """Step 3, inside :func:`generating`: ``repeat`` completions of each of ``samples`` (the next training batch,
    drawn here, when None), scored by the run's environment over the algorithm section's ``max_rollout_turns``
    (1 when it has none). The :class:`~rlcore.run.rollouts.Rollout`'s ``data`` is ready for
    :func:`~rlcore.run.step.training_batch`; ``rewards`` is ``[len(samples) * repeat]``, sample by sample.

    ``ahead``: generate through the engines' asynchronous calls (``generate_async`` and ``collect``), as a loop
    that generates ahead of training does from its rollout thread; each sample is then tagged with the weight
    version that generated it (``data['weight_version']``).

    A backend that serves requests continuously (``continuous_serving``: vLLM's async engine) gets each sample
    group as a request of its own, handled as it finishes (:mod:`rlcore.run.group_rollouts`), whether ``ahead``
    or not; its samples are tagged with their weight versions too (per token as well, with in-flight weight
    updates: ``data['generation_weight_versions']``)."""
    generation = run.generation
    if generation is None:
        raise ValueError("sample_and_score: this run has no generation backend")
    drawn = run.draw_train_batch() if samples is None else samples

    def generate(batch: Any) -> Any:
        if ahead:
            return generation.collect(generation.generate_async(batch, greedy=greedy))
        return generation.generate(batch, greedy=greedy)

    from rlcore.interfaces.agent import agent_of
    from rlcore.run.prompts import pad_id
    from rlcore.serving.server import exposed_endpoint

    if (agent := agent_of(run.environment)) is not None:  # an agent program over the endpoint (docs/agents.md)
        from rlcore.run.agent_rollouts import run_agent_rollout

        return run_agent_rollout(run.cfg, generation, agent, run.tokenizer, drawn, repeat, timer, greedy=greedy)
    with exposed_endpoint(run.cfg, generation, run.tokenizer, pad_id(run.tokenizer)):  # expose_http_server
        return run_rollout(
            run.cfg,
            generate,
            run.environment,
            run.tokenizer,
            drawn,
            repeat,
            timer,
            generation=generation,
            greedy=greedy,
        )


def step_rows(rows: int, run: RunContext) -> int:
    """The rows :func:`train_step` trains ``rows`` as: ``rows`` itself when it is a whole number of global
    batches, else (fewer than one) ``rows`` rounded up to what splits over the ranks (``data_parallel_size`` ×
    ``micro_batch_size`` with plain batching, ``data_parallel_size`` with token budgets); raises ValueError, in one
    line, for a count it cannot train in whole optimizer steps."""
    gbs = run.cfg.policy.train_global_batch_size
    if rows <= 0:
        raise ValueError("train_step: no rows to train; skip the step's training instead (nothing would change)")
    if rows % gbs == 0:
        return rows
    if rows > gbs:
        raise ValueError(
            f"train_step: {rows} rows are neither whole global batches of {gbs} (policy.train_global_batch_size) "
            f"nor fewer than one; train {rows // gbs * gbs} of them, or set it to a divisor of {rows}"
        )
    batch = run.batch
    unit = batch.data_parallel_size * (batch.micro_batch_size if batch.mode == "plain" else 1)
    return min(-(-rows // unit) * unit, gbs)


def pad_rows(data: BatchedDataDict[Any], rows: int) -> BatchedDataDict[Any]:
    """``data`` with copies of its first row appended up to ``rows``, each with ``sample_mask`` 0 (they count for
    nothing: no token of theirs is valid, the step's normalisation excludes them)."""
    import torch

    extra = rows - data.size
    if extra <= 0:
        return data
    if data.group_size != 1:
        raise ValueError(
            f"train_step: {data.size} rows in groups of {data.group_size} do not split over the ranks; "
            f"add masked whole groups up to {rows} rows"
        )
    padded = data.select_indices([*range(data.size), *[0] * extra])
    mask = data["sample_mask"].float() if "sample_mask" in data else torch.ones(data.size)
    padded["sample_mask"] = torch.cat([mask, torch.zeros(extra, dtype=mask.dtype)])
    return padded


def train_step(
    run: RunContext, data: BatchedDataDict[Any], loss_fn: LossFunction, timer: Timer | None = None
) -> dict[str, Any]:
    """Steps 6 and 7: train the policy on ``data`` (timed as ``train``) and mark the engines' weights stale;
    returns ``policy.train``'s result (``loss`` and ``grad_norm`` per optimizer step, ``metrics``).

    ``data``: whole global batches (one optimizer step each), or fewer rows than a global batch: one optimizer
    step on exactly those rows, padded with masked rows up to a size the ranks split (:func:`step_rows`), the
    same update as the whole global batch with the other rows masked."""
    rows = step_rows(data.size, run)
    whole = rows % run.cfg.policy.train_global_batch_size == 0
    padded = pad_rows(data, rows)
    with timer.phase("train") if timer is not None else nullcontext():
        run.policy.prepare_for_training()
        result = run.policy.train(padded, loss_fn) if whole else run.policy.train(padded, loss_fn, gbs=rows)
        run.policy.finish_training()
    if run.synchronizer is not None:
        run.synchronizer.stale = True
    return result


def moe_metrics(result: dict[str, Any]) -> dict[str, float]:
    """The router load-balancing loss of a mixture-of-experts step (rlcore.training.moe_aux), when it was trained."""
    from rlcore.training.moe_aux import METRIC

    value = result.get("metrics", {}).get(METRIC)
    return {} if value is None else {METRIC: float(value)}


def step_metrics(run: RunContext, result: dict[str, Any], timer: Timer, extra: dict[str, float]) -> dict[str, float]:
    """A step's row: the loss and grad norm of ``policy.train``'s ``result`` (mean over its optimizer steps), the
    algorithm's ``extra``, the data epoch, the phases' times and the peak memory."""
    return {
        "loss": float(result["loss"].mean()),
        "grad_norm": float(result["grad_norm"].mean()),
        "skipped_steps": float(result.get("skipped_steps", 0)),  # optimizer steps skipped for a non-finite value
        **moe_metrics(result),
        **extra,
        "epoch": float(run.data.train.epoch_of(run.next_batch - 1)),
        "time/step_s": sum(timer.seconds.values()),
        **timer.seconds,
        **peak_memory_metrics(run.policy, run.generation or run.policy),
    }


__all__ = [
    "Rollout",
    "Timer",
    "generating",
    "moe_metrics",
    "pad_rows",
    "refit_if_stale",
    "sample_and_score",
    "step_metrics",
    "step_rows",
    "train_rollout_steps",
    "train_step",
    "training_batch",
]
