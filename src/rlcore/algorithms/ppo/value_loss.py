"""The critic's loss: PPO2's clipped value loss (NeMo-RL's ``MseValueLossFn``), a
:class:`rlcore.interfaces.loss.LossFunction` whose first argument is the value model's ``values [B, S]`` (where a
language model's loss gets token logprobs; aligned the same way).

Per valid token (``token_mask * sample_mask`` at positions ``1..S-1``), with ``R`` the return
(``data['returns']``, :func:`rlcore.algorithms.ppo.gae.ppo_advantages`) and ``V_old`` the critic's values when the
rollout was scored (``data['values']``, NeMo-RL's key)::

    loss_t = 0.5 * (V - R)^2                                                   cliprange null
    loss_t = 0.5 * max((V - R)^2, (clamp(V, V_old - c, V_old + c) - R)^2)      cliprange c

and the loss is ``scale * sum over valid tokens / global_valid_toks``: token-level, so the micro-batches' losses
sum to the step's whatever the batch is cut into (design.md §2, contract 3).

Metrics (NeMo-RL's names), each this micro-batch's share, summed over micro-batches by
:func:`rlcore.interfaces.loss.step_metrics`: ``loss``; means over the step's valid tokens ``vf_clipfrac`` (where
the clipped error was the larger), ``values_mean``, ``returns_mean`` and the two moments explained variance needs,
``returns_sq_mean`` and ``residual_sq_mean`` (:func:`explained_variance` combines the step's sums); extremes
``values_min`` / ``values_max`` over this micro-batch (+inf / -inf without a valid token); raw counts
``num_valid_tokens`` and ``num_valid_samples``. Importing this module does not import torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from rlcore.algorithms.grpo.loss import extremes, sample_rows
from rlcore.algorithms.utils import masked_input, normalised_sum, valid_token_mask, zero_off_mask
from rlcore.interfaces.loss import LossType

if TYPE_CHECKING:
    import torch

    from rlcore.algorithms.ppo.config import ValueLossConfig
    from rlcore.data import BatchedDataDict

#: Where a batch holds the critic's values from when the rollout was scored (NeMo-RL's key).
OLD_VALUES_KEY = "values"
#: Where a batch holds the critic's targets.
RETURNS_KEY = "returns"
#: Floor of the returns' variance in :func:`explained_variance` (NeMo-RL's).
VARIANCE_FLOOR = 1e-8


class ValueLossFn:
    """The clipped value loss of the module docstring, configured by the critic's loss section
    (:class:`~rlcore.algorithms.ppo.config.ValueLossConfig`)."""

    loss_type = LossType.TOKEN_LEVEL

    def __init__(self, cfg: ValueLossConfig) -> None:
        self.cfg = cfg

    def __call__(
        self,
        values: torch.Tensor,
        data: BatchedDataDict[Any],
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        import torch

        mask = valid_token_mask(data, device=values.device)
        returns = masked_input(data, RETURNS_KEY, mask, values)
        if returns is None:
            raise KeyError(f"ValueLossFn needs data[{RETURNS_KEY!r}], the critic's targets (ppo.gae.ppo_advantages)")
        v = zero_off_mask(values, mask)  # padding may hold anything; its gradient must stay 0
        unclipped = (v - returns).square()
        per_token, clipped = unclipped, torch.zeros_like(mask)
        cliprange = self.cfg.cliprange
        if cliprange is not None:
            old = masked_input(data, OLD_VALUES_KEY, mask, values)
            if old is None:
                raise KeyError(
                    f"ValueLossFn needs data[{OLD_VALUES_KEY!r}], the critic's values at scoring, with cliprange set"
                )
            clipped_error = (torch.clamp(v, old - cliprange, old + cliprange) - returns).square()
            per_token = torch.maximum(unclipped, clipped_error)
            clipped = clipped_error > unclipped

        def token_mean(per: torch.Tensor) -> torch.Tensor:
            return normalised_sum(per, mask, LossType.TOKEN_LEVEL, global_valid_seqs, global_valid_toks)

        loss = 0.5 * self.cfg.scale * token_mean(per_token)
        with torch.no_grad():
            detached = v.detach()
            named = {
                "loss": loss.detach(),
                "vf_clipfrac": token_mean(clipped.to(values.dtype)),
                "values_mean": token_mean(detached),
                "returns_mean": token_mean(returns),
                "returns_sq_mean": token_mean(returns.square()),
                "residual_sq_mean": token_mean((returns - detached).square()),
                **extremes("values", detached, mask),
                "num_valid_tokens": mask.sum(),
                "num_valid_samples": sample_rows(data, mask).sum(),
            }
            metrics = dict(zip(named, torch.stack([m.to(torch.float64) for m in named.values()]).unbind()))
        return loss, metrics


def explained_variance(metrics: Mapping[str, float]) -> float:
    """``1 - Var(R - V) / Var(R)`` over the step's valid tokens, from :class:`ValueLossFn`'s summed metrics
    (:func:`~rlcore.interfaces.loss.step_metrics`): ``Var(R) = E[R^2] - E[R]^2`` and ``Var(R - V) = E[(R - V)^2] -
    (E[R] - E[V])^2``, the variance of the returns floored at 1e-8 (NeMo-RL's ``critic/explained_var``). 1: the
    critic predicts every return; 0: no better than their mean. NaN when the step had no valid token."""
    if not metrics.get("num_valid_tokens", 1.0):
        return math.nan
    returns_mean, values_mean = metrics["returns_mean"], metrics["values_mean"]
    returns_var = metrics["returns_sq_mean"] - returns_mean**2
    residual_var = metrics["residual_sq_mean"] - (returns_mean - values_mean) ** 2
    return 1.0 - residual_var / max(returns_var, VARIANCE_FLOOR)


__all__ = ["OLD_VALUES_KEY", "RETURNS_KEY", "ValueLossFn", "explained_variance"]
