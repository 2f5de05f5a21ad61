"""The on-policy distillation loop behind ``rlcore run`` (a config with a ``distillation`` section).

Per step (NeMo-RL's distillation): take the next ``distillation.num_prompts_per_step`` prompts; refit the
generation backend if its weights are stale; the *student* rolls out ``num_generations_per_prompt``
completions each (scored by the environment, for the metrics: nothing trains on the rewards); the frozen
*teacher* gives its top-``topk_logits_k`` logits at every position of those rollouts; the student trains one
optimizer step on :class:`~rlcore.algorithms.distillation.DistillationLossFn` over its generated tokens,
reading its own logits at the teacher's ids (the ``logits_at_indices`` loss input; with ``zero_outside_topk``
its full-vocabulary logprobs there and its entropy), computed by its backend without gathering the
vocabulary. The teacher's ``[B, S-1, k]`` tensors come back to the driver once and go to the student's ranks
with the rest of the batch. Validation is GRPO's: greedy completions scored by the environment
(``validation/accuracy``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rlcore.algorithms.toolkit import (
    Timer,
    generating,
    sample_and_score,
    step_metrics,
    train_rollout_steps,
    train_step,
    training_batch,
)
from rlcore.interfaces.algorithm import Algorithm, OnStep, Resolution

if TYPE_CHECKING:
    from rlcore.run.build import Run


def _aligned(next_token: Any) -> Any:
    """``[B, S-1, k]`` next-token rows (row ``i`` predicts token ``i + 1``) in the logprob alignment ``[B, S, k]``
    (row ``i`` scores token ``i``; row 0 is zeros)."""
    import torch

    return torch.cat([torch.zeros_like(next_token[:, :1]), next_token], dim=1)


def add_teacher_topk(teacher: Any, data: Any, k: int, tokens: Any = None) -> float:
    """The teacher's top-k logits and ids over every position of ``data``, as the loss reads them. ``tokens``
    (a :class:`~rlcore.algorithms.distillation.token_mapping.TeacherTokens`): the teacher has a tokenizer of its
    own; it reads the student's text re-tokenized, and its top-k are mapped back (positions it has no row for
    leave ``token_mask``). Returns the share of the trained tokens that got a teacher row."""
    from rlcore.algorithms.distillation import TEACHER_LOGITS_KEY
    from rlcore.algorithms.distillation.token_mapping import student_topk
    from rlcore.interfaces.loss import LOGIT_INDICES_KEY

    teacher.prepare_for_lp_inference()
    if tokens is None:
        top = teacher.get_topk_logits(data, k=k)
        data[TEACHER_LOGITS_KEY] = _aligned(top["topk_logits"])
        data[LOGIT_INDICES_KEY] = _aligned(top["topk_indices"])
        return 1.0
    teacher_data, rows = tokens.teacher_batch(
        data["input_ids"], data["input_lengths"], teacher.cfg.max_total_sequence_length
    )
    top = teacher.get_topk_logits(teacher_data, k=k)
    logits, ids, found = student_topk(_aligned(top["topk_logits"]), _aligned(top["topk_indices"]), rows, tokens.vocab)
    trained = data["token_mask"].sum()
    data["token_mask"] = data["token_mask"] * found.to(data["token_mask"].dtype)
    data[TEACHER_LOGITS_KEY], data[LOGIT_INDICES_KEY] = logits, ids
    return float(data["token_mask"].sum() / trained) if trained > 0 else 1.0


def same_ids(student: dict[str, int], teacher: dict[str, int]) -> bool:
    """Whether two vocabularies (token → id) give every token they share the same id and no id two tokens: one
    may add tokens at ids of its own (the tiny Qwen2 teacher's ``<|endoftext|>``), which the other never sees."""
    by_id = {i: token for token, i in student.items()}
    return all(student.get(token, i) == i and by_id.get(i, token) == token for token, i in teacher.items())


def teacher_tokens(run: Run) -> Any:
    """The run's :class:`~rlcore.algorithms.distillation.token_mapping.TeacherTokens` when the teacher has a
    tokenizer of its own whose vocabulary is not the student's (:func:`same_ids`), else None. A teacher without
    one (``distillation.teacher.tokenizer.name``) whose model's own tokenizer has another vocabulary is refused, as
    NeMo-RL's check_vocab_equality refuses it (which also refuses a vocabulary that only adds tokens)."""
    from transformers import AutoTokenizer

    from rlcore.algorithms.distillation.token_mapping import TeacherTokens
    from rlcore.config import ConfigError
    from rlcore.models import resolve_model

    d, student = run.cfg.distillation, run.tokenizer
    own = d.teacher_tokenizer(run.cfg.policy)
    if own is not None:
        teacher = AutoTokenizer.from_pretrained(resolve_model(own))
        return None if same_ids(student.get_vocab(), teacher.get_vocab()) else TeacherTokens(student, teacher)
    try:
        model_tokenizer = AutoTokenizer.from_pretrained(resolve_model(d.teacher_model_name))
    except (OSError, ValueError):  # no tokenizer beside the teacher's weights: nothing to compare
        return None
    if not same_ids(student.get_vocab(), model_tokenizer.get_vocab()):
        raise ConfigError(
            [
                f"distillation.teacher_model_name: the teacher's vocabulary ({len(model_tokenizer)} "
                f"tokens) is not the student's ({len(student)}), so its token ids mean other tokens; set "
                "distillation.teacher.tokenizer.name to the teacher's tokenizer (its top-k are then mapped "
                "through the token strings) or distil from a teacher of the student's vocabulary"
            ]
        )
    return None


def distillation_step(run: Run, loss_fn: Any, tokens: Any = None) -> dict[str, float]:
    """One step: the student's rollouts, the teacher's top-k on them (through ``tokens``, a cross-tokenizer
    teacher's mapping, see :func:`add_teacher_topk`), one optimizer step of the student."""
    import torch

    d = run.cfg.distillation
    timer = Timer()
    with generating(run, timer):
        rollout = sample_and_score(run, timer, d.num_generations_per_prompt)
    data = training_batch(rollout.data, torch.zeros_like(rollout.rewards))
    with timer.phase("teacher"):
        aligned = add_teacher_topk(run.teacher, data, d.topk_logits_k, tokens)
    result = train_step(run, data, loss_fn, timer)
    metrics = result["metrics"]
    return step_metrics(
        run,
        result,
        timer,
        {
            **{name: float(metrics[name]) for name in ("forward_kl", "reverse_kl") if name in metrics},
            "reward_mean": float(rollout.rewards.mean()),
            "mean_generation_length": float(rollout.data["generation_lengths"].float().mean()),
            **({"teacher_aligned_fraction": aligned} if tokens is not None else {}),
            **rollout.metrics,
        },
    )


def distillation_train(run: Run, on_step: Callable[[int, dict[str, float]], None]) -> str | None:
    """Run steps ``run.start_step .. run.num_steps - 1``, validating when due, calling ``on_step(step, metrics)``
    after each; returns why the run ended early (the epochs' data ran out), or None."""
    from rlcore.algorithms.distillation import DistillationLossFn

    loss_fn = DistillationLossFn(run.cfg.distillation.loss_settings())
    tokens = teacher_tokens(run)
    return train_rollout_steps(run, lambda step: distillation_step(run, loss_fn, tokens), on_step)


def _as_teacher(problem: str) -> str:
    """A problem of the teacher's policy, named where it is fixed: ``distillation.teacher.<key>`` for a policy
    key (the teacher's own settings override the student's), the teacher's model otherwise."""
    if problem.startswith("policy."):
        return "distillation.teacher." + problem[len("policy.") :]
    return f"distillation.teacher_model_name: {problem}"


class Distillation(Algorithm):
    """On-policy distillation: the student generates, a frozen teacher gives its top-k, the student trains the
    KL to it."""

    headline = ("loss", "validation/accuracy")
    curve = ("loss", "KL to the teacher", "kl_curve.png")

    def resolve(self, cfg: Any, policy: Any, generation: Any, registry: Any, notices: list[str]) -> Resolution:
        """The teacher: a Policy of the student's policy settings with ``distillation.teacher`` over them and
        ``distillation.teacher_model_name``, frozen, with its own layout on the same workers. The
        student's backend must compute the loss's input, the teacher's its top-k; every rollout must fill whole
        batches."""
        from rlcore.algorithms.distillation import DistillationLossFn
        from rlcore.config import ConfigError
        from rlcore.config.resolve import resolve_policy
        from rlcore.interfaces.loss import LOSS_INPUTS
        from rlcore.plugins import Capability

        d, problems, student = cfg.distillation, [], policy
        for name in DistillationLossFn(d.loss_settings()).inputs:
            if not student.spec.supports(LOSS_INPUTS[name]):
                setting = " (distillation.zero_outside_topk: true)" if d.zero_outside_topk else ""
                problems.append(
                    f"distillation: the '{student.spec.name}' training backend does not declare "
                    f"'{LOSS_INPUTS[name]}', a loss input distillation trains on{setting}; use a backend "
                    "that does (reference, dtensor, fsdp1, megatron)"
                )
        rollout = d.num_prompts_per_step * d.num_generations_per_prompt
        gbs = student.config.train_global_batch_size
        if rollout % gbs or rollout % student.data_parallel_size:
            problems.append(
                f"distillation.num_prompts_per_step × num_generations_per_prompt = {rollout} must be a "
                f"multiple of policy.train_global_batch_size {gbs} (and of the data-parallel size "
                f"{student.data_parallel_size}); change one of them"
            )
        if problems:
            return Resolution(cfg, problems)
        try:  # a dict: validated and checked by the cross-field rules as the teacher's own policy
            teacher = resolve_policy(
                d.teacher_policy(cfg.policy), world_size=cfg.world_size, use_gpu=cfg.cluster.use_gpu, registry=registry
            )
        except ConfigError as exc:
            return Resolution(cfg, [_as_teacher(p) for p in exc.problems])
        if not teacher.spec.supports(Capability.TOPK_LOGITS):
            return Resolution(
                cfg,
                [
                    f"distillation: the teacher's '{teacher.spec.name}' training backend cannot give "
                    "its top-k logits (capability 'topk_logits'); give the teacher another backend "
                    "(distillation.teacher.backend)"
                ],
            )
        return Resolution(cfg, [], teacher=teacher)

    def load_data(self, cfg: Any, tokenizer: Any) -> Any:
        """The samples, each fixed one with an assistant message, as SFT checks them."""
        from rlcore.algorithms.sft.batches import answer_problem
        from rlcore.algorithms.sft.loop import checked_samples
        from rlcore.datasets import load_sources

        return checked_samples(load_sources(cfg), answer_problem)

    def train(self, run: Run, on_step: OnStep) -> str | None:
        return distillation_train(run, on_step)

    def validate(self, run: Run) -> dict[str, float]:
        from rlcore.run.validation import synchronous_generate, validate

        return validate(run, synchronous_generate(run))

    def what(self, cfg: Any) -> str:
        from pathlib import Path

        return f"distillation from {Path(cfg.distillation.teacher_model_name).name}, "
