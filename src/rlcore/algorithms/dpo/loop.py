"""The DPO loop behind ``rlcore run`` (a config with a ``dpo`` section): one step, validation, the steps of a run.

Per step: take the next ``policy.train_global_batch_size`` preference samples, encode each as a chosen and a
rejected sequence kept together (:mod:`rlcore.algorithms.dpo.batches`), add the frozen reference policy's logprobs
(the initial weights, which every rank keeps; computed for ``dpo.reference_batches_per_swap`` batches at a time,
:mod:`rlcore.algorithms.dpo.reference`), and train one optimizer step with
:class:`~rlcore.algorithms.preference.DPOLossFn`. As in NeMo-RL, ``policy.train_global_batch_size`` and
``policy.train_micro_batch_size`` count pairs: the policy sees twice as many sequences. Validation runs the
same loss in eval mode over ``dpo.val_batches`` batches of ``dpo.val_global_batch_size`` pairs; each
validation metric is its mean over the valid pairs of all of them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rlcore.algorithms.sft.loop import EmptyStep, OfflineAlgorithm
from rlcore.algorithms.toolkit import Timer, step_metrics
from rlcore.interfaces.algorithm import OnStep, Resolution

if TYPE_CHECKING:
    from rlcore.algorithms.dpo.reference import ReferenceLogprobs
    from rlcore.run.build import Run

#: Loss metrics a DPO step reports (each the step's mean over its valid pairs).
PAIR_METRICS = (
    "accuracy",
    "preference_loss",
    "sft_loss",
    "rewards_chosen_mean",
    "rewards_rejected_mean",
    "rewards_margin_mean",
)


def _train_pairs(
    run: Run,
    batch: Any,
    eval_mode: bool,
    pairs: int,
    pairs_per_micro_batch: int,
    timer: Timer,
    reference: Callable[[], Any] | None = None,
) -> dict[str, Any]:
    """The reference logprobs (``reference()``'s, default: computed for ``batch`` alone), then one optimizer step
    (or, ``eval_mode``, the loss alone) on ``batch``."""
    from rlcore.algorithms.dpo.loss import DPOLossFn
    from rlcore.algorithms.dpo.reference import reference_logprobs

    policy = run.policy
    with timer.phase("logprob"):
        batch["reference_policy_logprobs"] = reference() if reference else reference_logprobs(policy, [batch])[0]
    with timer.phase("train"):
        policy.prepare_for_training()
        result = policy.train(
            batch,
            DPOLossFn(run.cfg.dpo.loss_settings()),
            eval_mode=eval_mode,
            gbs=2 * pairs,
            mbs=2 * pairs_per_micro_batch,
        )
        policy.finish_training()
    return result


def dpo_step(run: Run, reference: ReferenceLogprobs | None = None) -> dict[str, float]:
    """One optimizer step of DPO on the next batch of preference samples (:class:`EmptyStep` when no pair
    trains: each is cut, or its chosen response equals its rejected one); its reference logprobs from
    ``reference`` (default: computed for this batch alone, one weight swap)."""
    from rlcore.algorithms.dpo.batches import dpo_batch, nothing_preferred, teaches

    p, timer = run.cfg.policy, Timer()
    with timer.phase("data"):
        index = run.next_batch
        samples = run.draw_train_batch()
        batch = dpo_batch(samples, run.tokenizer, run.cfg)
    fits = batch["sample_mask"][::2].tolist()
    if not any(fit and teaches(sample, run.cfg) for fit, sample in zip(fits, samples)):
        raise EmptyStep(nothing_preferred(samples, run.tokenizer, run.cfg) or "no pair has a response to train")
    result = _train_pairs(
        run,
        batch,
        False,
        p.train_global_batch_size,
        p.train_micro_batch_size,
        timer,
        (lambda: reference.for_train_batch(index, batch)) if reference else None,
    )
    metrics = result["metrics"]
    return step_metrics(
        run,
        result,
        timer,
        {
            **{name: float(metrics[name]) for name in PAIR_METRICS if name in metrics},
            "cut_pairs": float((batch["sample_mask"][::2] == 0).sum()),  # too long: sft.batches.LengthRule
        },
    )


def dpo_validate(run: Run, reference: ReferenceLogprobs | None = None) -> dict[str, float]:
    """The loss and pair metrics of the validation samples, in eval mode, weighted by each batch's valid pairs
    (the reference logprobs of all batches from ``reference``, one swap; default: one swap per batch)."""
    from rlcore.algorithms.dpo.batches import dpo_batch

    cfg, started = run.cfg.dpo, time.perf_counter()
    samples = run.data.validation or []
    size = cfg.val_global_batch_size
    sums: dict[str, float] = {}
    pairs = 0.0
    batches = [
        dpo_batch(samples[begin : begin + size], run.tokenizer, run.cfg, size=size)
        for begin in range(0, len(samples), size)
    ]
    references = reference.for_validation(batches) if reference and batches else [None] * len(batches)
    for batch, values in zip(batches, references):
        result = _train_pairs(
            run, batch, True, size, cfg.val_micro_batch_size, Timer(), None if values is None else (lambda v=values: v)
        )
        valid = float(batch["sample_mask"][::2].sum())
        values = {
            "loss": float(result["loss"][0]),
            **{k: float(v) for k, v in result["metrics"].items() if k in PAIR_METRICS},
        }
        for name, value in values.items():
            sums[name] = sums.get(name, 0.0) + value * valid  # each batch's value is its mean over its pairs
        pairs += valid
    return {
        **{f"validation/{name}": total / pairs if pairs else float("nan") for name, total in sums.items()},
        "validation/num_pairs": pairs,
        "time/validation_s": time.perf_counter() - started,
    }


def dpo_train(run: Run, on_step: Callable[[int, dict[str, float]], None]) -> str | None:
    """The steps of a DPO run (:func:`rlcore.algorithms.sft.loop.offline_train`), reference logprobs computed
    ``dpo.reference_batches_per_swap`` batches at a time (a fresh cache per process: a resumed run recomputes)."""
    from rlcore.algorithms.dpo.reference import ReferenceLogprobs
    from rlcore.algorithms.sft.loop import offline_train

    reference = ReferenceLogprobs(run, run.cfg.dpo.reference_batches_per_swap)
    return offline_train(run, on_step, lambda r: dpo_step(r, reference), lambda r: dpo_validate(r, reference))


class PreferencePairs(OfflineAlgorithm):
    """An offline algorithm on (prompt, chosen, rejected) pairs (DPO, a reward model's training): each row must
    be a pair, and a micro-batch keeps a pair's two sequences together."""

    headline = ("accuracy", "validation/accuracy")
    curve = ("accuracy", "preference accuracy", "accuracy_curve.png")

    def resolve(self, cfg: Any, policy: Any, generation: Any, registry: Any, notices: list[str]) -> Resolution:
        """As SFT's, and a micro-batch token budget must hold a pair (its two sequences stay together)."""
        decided = super().resolve(cfg, policy, generation, registry, notices)
        plan, pair_tokens = policy.batch, 2 * cfg.policy.max_total_sequence_length
        if plan.mode != "plain" and plan.train_mb_tokens < pair_tokens:
            section = "dynamic_batching" if plan.mode == "dynamic" else "sequence_packing"
            decided.problems.append(
                f"policy.{section}.train_mb_tokens: {plan.train_mb_tokens} tokens cannot hold a preference pair, "
                f"two sequences of up to policy.max_total_sequence_length={cfg.policy.max_total_sequence_length} "
                f"kept in one micro-batch; set it to at least {pair_tokens}"
            )
        return decided

    def sample_problem(self, sample: Any, where: str) -> str | None:
        from rlcore.algorithms.dpo.batches import preference_pair

        preference_pair(sample, where)  # raises DataError naming the row
        return None


class DPO(PreferencePairs):
    """Direct Preference Optimization on (prompt, chosen, rejected) pairs against the frozen initial weights."""

    def nothing_trained(self, samples: list[Any], tokenizer: Any, cfg: Any) -> str | None:
        from rlcore.algorithms.dpo.batches import nothing_preferred

        return nothing_preferred(samples, tokenizer, cfg)

    def needs_reference_model(self, cfg: Any) -> bool:
        return True  # the loss is relative to the frozen initial weights

    def train(self, run: Run, on_step: OnStep) -> str | None:
        return dpo_train(run, on_step)

    def validate(self, run: Run) -> dict[str, float]:
        return dpo_validate(run)
