"""The Bradley-Terry loss of a reward model on preference pairs (NeMo-RL's ``PreferenceLossFn`` of its RM).

With ``r`` a sequence's reward (the value model's score at its last real token, read by
:func:`rlcore.algorithms.rm.scoring.scores_from_values` from a batch carrying the score position,
:mod:`rlcore.algorithms.rm.batches`), each valid pair ``(chosen, rejected)`` contributes
``-log sigmoid(r_chosen - r_rejected)``; the loss is the sum over the micro-batch's valid pairs divided by the
step's valid pairs (``global_valid_seqs / 2``), so the micro-batch losses of a step add up to its mean over pairs
whatever the split (the loss protocol, :class:`~rlcore.interfaces.LossType` ``SEQUENCE_LEVEL``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from rlcore.algorithms.utils import normaliser, valid_token_mask
from rlcore.interfaces.loss import LossType

if TYPE_CHECKING:
    import torch

#: The metrics of a step or a validation, each its mean over valid pairs (``num_valid_samples``: a count).
PAIR_METRICS = ("loss", "accuracy", "rewards_margin_mean", "rewards_chosen_mean", "rewards_rejected_mean")


def pair_rewards(values: torch.Tensor, data: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(r_chosen, r_rejected)`` ``[B / 2]`` of a micro-batch's aligned values: each row's score at its last real
    token, ``values[b, input_lengths[b] - 1]`` (the rows carry the score position)."""
    from rlcore.algorithms.rm.scoring import scores_from_values

    rewards = scores_from_values(values, data["input_lengths"].to(values.device) - 1)
    return rewards[0::2], rewards[1::2]


class BradleyTerryLossFn:
    """``-log sigmoid(r_chosen - r_rejected)`` per pair, over a value model's values (see the module docstring).

    Metrics, each this micro-batch's share of the step's mean over valid pairs: ``loss``, ``accuracy`` (the
    fraction with ``r_chosen > r_rejected``), ``rewards_margin_mean`` (``r_chosen - r_rejected``),
    ``rewards_chosen_mean`` and ``rewards_rejected_mean``; and ``num_valid_samples``, the micro-batch's valid pairs.
    Rows must be whole pairs (DPO's :func:`~rlcore.algorithms.dpo.loss.check_pairs`).
    """

    loss_type = LossType.SEQUENCE_LEVEL

    def __call__(
        self,
        values: torch.Tensor,
        data: Mapping[str, Any],
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        import torch

        from rlcore.algorithms.dpo.loss import check_pairs

        valid_pair = check_pairs(data, valid_token_mask(data, values.device))
        chosen, rejected = pair_rewards(values.float(), data)
        weight = valid_pair.to(chosen.dtype)
        pairs = normaliser(torch.as_tensor(global_valid_seqs, device=values.device) / 2, chosen)

        def pair_mean(per_pair: torch.Tensor) -> torch.Tensor:
            return (per_pair.to(chosen.dtype) * weight).sum() / pairs

        margin = chosen - rejected
        loss = pair_mean(-torch.nn.functional.logsigmoid(margin))
        with torch.no_grad():
            named = {
                "loss": loss,
                "accuracy": pair_mean(margin > 0),
                "rewards_margin_mean": pair_mean(margin),
                "rewards_chosen_mean": pair_mean(chosen),
                "rewards_rejected_mean": pair_mean(rejected),
                "num_valid_samples": weight.sum(),
            }
            metrics = torch.stack([v.detach().to(torch.float64) for v in named.values()]).unbind()
        return loss, dict(zip(named, metrics))


__all__ = ["PAIR_METRICS", "BradleyTerryLossFn", "pair_rewards"]
