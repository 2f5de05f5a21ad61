"""The GRPO loop behind ``rlcore run``: one step, and the steps of a run.

Per step: take the next batch of samples (their message logs through
``policy.tokenizer.chat_template``); refit the generation backend if its weights are stale; roll out a
group of trajectories per prompt (:mod:`rlcore.run.rollouts`: generate, cut to
``policy.max_total_sequence_length``, score with the environment; over ``grpo.max_rollout_turns`` turns
the environment answers and generation goes on; with ``grpo.use_dynamic_sampling``, batch after batch
until enough groups have signal: :mod:`rlcore.run.dynamic_sampling`); compute group-relative advantages; compute
``prev_logprobs`` (and reference logprobs when the loss has a KL term) with the policy, unless
resolution decided the loss uses the current logprobs
(:func:`rlcore.config.resolve.skips_prev_logprob_pass`); train with ``ClippedPGLossFn``; mark the
generation weights stale; validate when ``grpo.val_period`` says so. The pieces it runs on are started
by :func:`rlcore.run.build.build_run`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from rlcore.datasets import DataExhausted
from rlcore.run.async_grpo import async_grpo_train
from rlcore.run.dynamic_sampling import sample_with_signal
from rlcore.run.rollouts import run_rollout
from rlcore.run.step import Timer, peak_memory_metrics, refit, train_on_rollout
from rlcore.run.validation import synchronous_generate, validate, validation_due

if TYPE_CHECKING:
    from rlcore.run.build import Run


def grpo_step(run: "Run", step: int, loss_fn: Any) -> dict[str, float]:
    """One synchronous GRPO step on the next batch of data: refit (if stale), generate, score, train."""
    from rlcore.run.prompts import pad_id

    cfg, policy, generation, synchronizer = run.cfg, run.policy, run.generation, run.synchronizer
    timer = Timer()
    refit_bytes = 0.0
    if synchronizer is not None and synchronizer.stale:
        with timer.phase("refit"):
            refit_bytes = refit(policy, synchronizer)
    with timer.phase("generation"):
        generation.prepare_for_generation()

    def roll_out(samples: list[Any]) -> Any:
        return run_rollout(cfg, lambda batch: generation.generate(batch, greedy=False), run.environment,
                           run.tokenizer, samples, cfg.grpo.num_generations_per_prompt, timer)

    sampling: dict[str, float] = {}
    if cfg.grpo.use_dynamic_sampling:
        rollout, sampling = sample_with_signal(cfg, run.draw_train_batch, roll_out, pad_id(run.tokenizer))
    else:
        rollout = roll_out(run.draw_train_batch())
    with timer.phase("generation"):
        generation.finish_generation()
    metrics = train_on_rollout(cfg, policy, loss_fn, rollout, timer)
    if synchronizer is not None:
        synchronizer.stale = True
    generated = sampling.get("dynamic_sampling/generated_tokens", float(rollout.data["generation_lengths"].sum()))
    return {
        **metrics,
        **sampling,  # with dynamic sampling: the rewards of every generated sample, not only the trained ones
        "epoch": float(run.data.train.epoch_of(run.next_batch - 1)),
        "tokens_per_s": generated / max(timer.seconds.get("time/generation_s", 0.0), 1e-9),
        "refit_bytes": refit_bytes,  # what the refit moved (LoRA: the changed layers, or the adapters alone)
        "time/step_s": sum(timer.seconds.values()),
        **timer.seconds,
        **peak_memory_metrics(policy, generation),
    }


def grpo_train(run: "Run", on_step: Callable[[int, dict[str, float]], None]) -> str | None:
    """Run steps ``run.start_step .. run.num_steps - 1``, calling ``on_step(step, metrics)`` after each.

    Generation runs ahead of training (:mod:`rlcore.run.async_grpo`) where the resolved config says so.
    Returns None, or why the run ended before ``run.num_steps`` (dynamic sampling used up the epochs' data
    inside a step; the steps before it are complete).
    """
    from rlcore.algorithms.loss_functions import ClippedPGLossFn

    loss_fn = ClippedPGLossFn(run.cfg.loss)  # force_on_policy_ratio was decided when the config was resolved
    if run.resolved.async_generation:
        async_grpo_train(run, loss_fn, on_step)
        return None
    for step in range(run.start_step, run.num_steps):
        try:
            metrics = grpo_step(run, step, loss_fn)
        except DataExhausted as exc:  # dynamic sampling drew the last batch the epochs allow inside this step
            return f"the data ran out during step {step} ({exc})"
        if validation_due(run, step):
            metrics.update(validate(run, synchronous_generate(run)))
        on_step(step, metrics)
    return None
