"""The reward-model loop behind ``rlcore run`` (a config with an ``rm`` section): one step, validation, the run.

The policy is built as a value model (``Resolution.policy_head = "value"``: the trunk of ``policy.model_name`` and
a scalar ``score`` head, so the backend must declare ``value_head``). Per step: take the next
``policy.train_global_batch_size`` preference samples, encode each as a chosen and a rejected sequence kept
together, each with its score position (:mod:`rlcore.algorithms.rm.batches`), and train one optimizer step with
:class:`~rlcore.algorithms.rm.loss.BradleyTerryLossFn`. As in NeMo-RL, ``policy.train_global_batch_size`` and
``policy.train_micro_batch_size`` count pairs: the model sees twice as many sequences. Validation runs the same
loss in eval mode over ``rm.val_batches`` batches of ``rm.val_global_batch_size`` pairs and logs
``validation/accuracy``, ``validation/margin`` (the mean of ``r_chosen - r_rejected``) and ``validation/loss``, each
the mean over the valid pairs of all batches. The checkpoints' ``weights/`` load with
``transformers.AutoModelForTokenClassification``; :mod:`rlcore.algorithms.rm.scoring` reads a sequence's reward.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from rlcore.algorithms.dpo.loop import PreferencePairs
from rlcore.algorithms.sft.loop import EmptyStep, offline_train
from rlcore.algorithms.toolkit import Timer, step_metrics
from rlcore.interfaces.algorithm import OnStep, Resolution

if TYPE_CHECKING:
    from rlcore.run.build import Run

#: The name each loss metric is logged under (validation: ``validation/<name>``).
LOGGED = {
    "loss": "loss",
    "accuracy": "accuracy",
    "rewards_margin_mean": "margin",
    "rewards_chosen_mean": "rewards_chosen_mean",
    "rewards_rejected_mean": "rewards_rejected_mean",
}


def _train_pairs(run: Run, batch: Any, eval_mode: bool, pairs: int, pairs_per_micro_batch: int) -> dict[str, Any]:
    """One optimizer step (or, ``eval_mode``, the loss alone) of the Bradley-Terry loss on ``batch``."""
    from rlcore.algorithms.rm.loss import BradleyTerryLossFn

    policy = run.policy
    policy.prepare_for_training()
    result = policy.train(
        batch, BradleyTerryLossFn(), eval_mode=eval_mode, gbs=2 * pairs, mbs=2 * pairs_per_micro_batch
    )
    policy.finish_training()
    return result


def _pair_metrics(result: dict[str, Any]) -> dict[str, float]:
    metrics = result["metrics"]
    return {logged: float(metrics[name]) for name, logged in LOGGED.items() if name in metrics}


def rm_step(run: Run) -> dict[str, float]:
    """One optimizer step on the next batch of preference samples (:class:`EmptyStep` when no pair trains)."""
    from rlcore.algorithms.dpo.batches import preference_pair
    from rlcore.algorithms.rm.batches import nothing_preferred, rm_batch

    p, timer = run.cfg.policy, Timer()
    with timer.phase("data"):
        samples = run.draw_train_batch()
        batch = rm_batch(samples, run.tokenizer, run.cfg)
    fits = batch["sample_mask"][::2].tolist()
    differ = [chosen != rejected for _, chosen, rejected in (preference_pair(s, "data.train") for s in samples)]
    if not any(fit and d for fit, d in zip(fits, differ)):
        raise EmptyStep(nothing_preferred(samples, run.tokenizer, run.cfg) or "no pair has two responses to compare")
    with timer.phase("train"):
        result = _train_pairs(run, batch, False, p.train_global_batch_size, p.train_micro_batch_size)
    extra = {k: v for k, v in _pair_metrics(result).items() if k != "loss"}
    extra["cut_pairs"] = float((batch["sample_mask"][::2] == 0).sum())
    return step_metrics(run, result, timer, extra)


def rm_validate(run: Run) -> dict[str, float]:
    """``validation/accuracy``, ``validation/margin``, ``validation/loss`` (and the reward means) of the validation
    pairs in eval mode, each batch weighted by its valid pairs; ``validation/num_pairs``."""
    from rlcore.algorithms.rm.batches import rm_batch

    cfg, started = run.cfg.rm, time.perf_counter()
    samples = run.data.validation or []
    size = cfg.val_global_batch_size
    sums: dict[str, float] = {}
    pairs = 0.0
    for begin in range(0, len(samples), size):
        batch = rm_batch(samples[begin : begin + size], run.tokenizer, run.cfg, size=size)
        result = _train_pairs(run, batch, True, size, cfg.val_micro_batch_size)
        valid = float(batch["sample_mask"][::2].sum())
        for name, value in _pair_metrics(result).items():
            sums[name] = sums.get(name, 0.0) + value * valid  # each batch's value is its mean over its pairs
        pairs += valid
    return {
        **{f"validation/{name}": total / pairs if pairs else float("nan") for name, total in sums.items()},
        "validation/num_pairs": pairs,
        "time/validation_s": time.perf_counter() - started,
    }


class RM(PreferencePairs):
    """Bradley-Terry reward-model training: the policy as a value model, ``-log sigmoid(r_chosen - r_rejected)``."""

    def resolve(self, cfg: Any, policy: Any, generation: Any, registry: Any, notices: list[str]) -> Resolution:
        """As DPO's (pairs kept together); the policy is built as a value model, on a backend that can."""
        from rlcore.plugins import Capability

        decided = super().resolve(cfg, policy, generation, registry, notices)
        decided.policy_head = "value"
        if not policy.spec.supports(Capability.VALUE_HEAD):
            decided.problems.append(
                f"policy.backend: '{policy.spec.name}' cannot build a value model (capability 'value_head'), which "
                "a reward model is; use a backend that declares it (dtensor or megatron)"
            )
        return decided

    def nothing_trained(self, samples: list[Any], tokenizer: Any, cfg: Any) -> str | None:
        from rlcore.algorithms.rm.batches import nothing_preferred

        return nothing_preferred(samples, tokenizer, cfg)

    def train(self, run: Run, on_step: OnStep) -> str | None:
        return offline_train(run, on_step, rm_step, rm_validate)

    def validate(self, run: Run) -> dict[str, float]:
        return rm_validate(run)
