"""The GRPO loop behind ``rlcore run``: one step, and the steps of a run.

Per step: take the next batch of samples (their message logs through
``policy.tokenizer.chat_template``); refit the generation backend if its weights are stale; roll out a
group of trajectories per prompt (:mod:`rlcore.run.rollouts`: generate, cut to
``policy.max_total_sequence_length``, score with the environment; over ``grpo.max_rollout_turns`` turns
the environment answers and generation goes on; with ``grpo.use_dynamic_sampling``, batch after batch
until enough groups have signal: :mod:`rlcore.algorithms.grpo.dynamic_sampling`); compute group-relative
advantages; compute ``prev_logprobs`` (and reference logprobs when the loss has a KL term) with the policy, unless
resolution decided the loss uses the current logprobs
(:func:`rlcore.algorithms.grpo.prev_logprobs.skips_prev_logprob_pass`); train with ``ClippedPGLossFn``; mark the
generation weights stale; validate when ``grpo.val_period`` says so. The pieces it runs on are started
by :func:`rlcore.run.build.build_run`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rlcore.algorithms.grpo.async_loop import async_grpo_train
from rlcore.algorithms.grpo.dynamic_sampling import sample_with_signal
from rlcore.algorithms.grpo.step import train_on_rollout
from rlcore.algorithms.toolkit import Timer, generating, sample_and_score, train_rollout_steps
from rlcore.interfaces.algorithm import Algorithm, OnStep, Resolution
from rlcore.run.step import peak_memory_metrics
from rlcore.run.validation import synchronous_generate, validate

if TYPE_CHECKING:
    from rlcore.run.build import Run


def grpo_step(run: Run, step: int, loss_fn: Any) -> dict[str, float]:
    """One synchronous GRPO step on the next batch of data: refit (if stale), generate, score, train."""
    from rlcore.run.prompts import pad_id

    cfg, policy, generation = run.cfg, run.policy, run.generation
    timer = Timer()
    with generating(run, timer) as refit_bytes:

        def roll_out(samples: list[Any]) -> Any:
            return sample_and_score(run, timer, cfg.grpo.num_generations_per_prompt, samples)

        sampling: dict[str, float] = {}
        if cfg.grpo.use_dynamic_sampling:
            rollout, sampling = sample_with_signal(cfg, run.draw_train_batch, roll_out, pad_id(run.tokenizer))
        else:
            rollout = roll_out(run.draw_train_batch())
    metrics = train_on_rollout(run, loss_fn, rollout, timer)
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


def grpo_train(run: Run, on_step: Callable[[int, dict[str, float]], None]) -> str | None:
    """Run steps ``run.start_step .. run.num_steps - 1``, calling ``on_step(step, metrics)`` after each.

    Generation runs ahead of training (:mod:`rlcore.algorithms.grpo.async_loop`) where the resolved config says so.
    Returns None, or why the run ended before ``run.num_steps`` (dynamic sampling used up the epochs' data
    inside a step; the steps before it are complete).
    """
    from rlcore.algorithms.grpo.loss import ClippedPGLossFn

    loss_fn = ClippedPGLossFn(run.cfg.loss)  # force_on_policy_ratio was decided when the config was resolved
    if run.resolved.async_generation:
        async_grpo_train(run, loss_fn, on_step)
        return None
    return train_rollout_steps(run, lambda step: grpo_step(run, step, loss_fn), on_step)


class GRPO(Algorithm):
    """GRPO (rlcore's default algorithm): group-relative advantages on scored rollouts, synchronous or with
    generation ahead (``grpo.async_grpo``), with dynamic sampling (``grpo.use_dynamic_sampling``)."""

    headline = ("reward_mean", "validation/accuracy")
    curve = ("reward_mean", "mean reward", "reward_curve.png")

    def resolve(self, cfg: Any, policy: Any, generation: Any, registry: Any, notices: list[str]) -> Resolution:
        from rlcore.algorithms.grpo.prev_logprobs import skips_prev_logprob_pass

        g = cfg.grpo
        problems: list[str] = []
        rollout, dp = g.num_prompts_per_step * g.num_generations_per_prompt, policy.data_parallel_size
        if rollout % dp:
            problems.append(
                f"grpo rollout batch {rollout} cannot be split over {dp} data-parallel ranks; "
                "make grpo.num_prompts_per_step × grpo.num_generations_per_prompt a multiple of it"
            )
        if problems:
            return Resolution(cfg, problems)
        async_generation = _async_generation(g, generation, notices)
        if async_generation and not cfg.loss.use_importance_sampling_correction:
            notices.append(uncorrected_notice(g.async_grpo.max_trajectory_age_steps))
        if problem := _in_flight_problem(g, generation, async_generation):
            return Resolution(cfg, [problem])
        cfg = cfg.model_copy(
            update={
                "loss": cfg.loss.model_copy(
                    update={"force_on_policy_ratio": skips_prev_logprob_pass(cfg, policy.config)}
                )
            }
        )
        return Resolution(cfg, [], async_generation)

    def load_data(self, cfg: Any, tokenizer: Any) -> Any:
        from rlcore.datasets import load_sources
        from rlcore.run.image_prompts import image_model_of
        from rlcore.run.step import prompt_length_of

        return load_sources(cfg, prompt_length_of(cfg, tokenizer), images=image_model_of(cfg) is not None)

    def needs_reference_model(self, cfg: Any) -> bool:
        return cfg.loss.reference_policy_kl_penalty > 0  # the KL term (in the loss, or in the reward)

    def one_batch_per_step(self, cfg: Any) -> bool:
        return not cfg.grpo.use_dynamic_sampling  # dynamic sampling draws until enough groups have signal

    def train(self, run: Run, on_step: OnStep) -> str | None:
        return grpo_train(run, on_step)

    def validate(self, run: Run) -> dict[str, float]:
        return validate(run, synchronous_generate(run))


def _async_generation(g: Any, generation: Any, notices: list[str]) -> bool:
    """``grpo.async_grpo.enabled`` where the engine can generate ahead; a notice where it cannot."""
    if not g.async_grpo.enabled or generation is None:
        return False
    reason = _why_not_ahead(generation)
    if reason is None:
        return True
    notices.append(f"notice: grpo.async_grpo.enabled, but {reason}; training synchronously")
    return False


def uncorrected_notice(max_age: int) -> str:
    """The notice of asynchronous GRPO without importance weights (NeMo-RL's single-controller loop trains so;
    its older ``grpo.async_grpo`` loop refuses it)."""
    return (
        "notice: grpo.async_grpo.enabled with loss.use_importance_sampling_correction false: rollouts from "
        f"weights up to {max_age} step(s) older are trained as if on-policy (the ratio is taken against the "
        "trainer's logprobs, not the engine's); set it to true to correct for their age"
    )


def _why_not_ahead(generation: Any) -> str | None:
    """Why ``generation`` cannot generate ahead of training, or None when it can."""
    from rlcore.plugins import Capability

    if not generation.separate:
        return f"the '{generation.spec.name}' training backend generates with its own weights"
    if not generation.spec.supports(Capability.ASYNC_GENERATION):
        return f"the '{generation.spec.name}' generation backend does not declare 'async_generation'"
    return None


def _in_flight_problem(g: Any, generation: Any, async_generation: bool) -> str | None:
    """The refusal of ``grpo.async_grpo.in_flight_weight_updates`` where the run's engine cannot take weights while
    requests run (the backend's own check refuses a config of it that cannot, e.g. rl-vllm without async_engine)."""
    from rlcore.plugins import Capability

    if not g.async_grpo.in_flight_weight_updates or generation is None:
        return None
    path = "grpo.async_grpo.in_flight_weight_updates"
    if not async_generation:
        reason = _why_not_ahead(generation) or "generation does not run ahead"
        return f"{path}: is true, but {reason}, so no refit can land during generation; set it to false"
    if not generation.spec.supports(Capability.IN_FLIGHT_WEIGHT_UPDATES):
        return (
            f"{path}: is true, but the '{generation.spec.name}' generation backend does not declare "
            "'in_flight_weight_updates' (its refits wait for the requests running); set it to false"
        )
    return None
