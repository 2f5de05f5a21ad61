"""The router load-balancing (auxiliary) loss of a mixture-of-experts model, normalised per step.

The rule (design.md §2.3 extended to the aux term):

- It is trained when the model's Hugging Face config says so: ``output_router_logits`` true and
  ``router_aux_loss_coef`` not 0 (set them with ``policy.hf_config_overrides``). NeMo-RL's dtensor worker
  reads only the logits and never trains it; rlcore follows the config, which by default (false) agrees.
- Per forward it is Hugging Face's ``load_balancing_loss_func`` (Switch Transformer): over the forward's
  routed tokens and every MoE layer, ``E * sum_e f_e * P_e`` with ``f_e`` the fraction of top-k
  assignments to expert ``e`` and ``P_e`` its mean router probability. Routed tokens are the real tokens
  (positions before ``input_lengths``) of the rows whose ``sample_mask`` is 1.
- A step's aux loss is the token-weighted mean of its forwards': each micro-batch adds
  ``coef * aux_mb * n_mb / N`` to its loss, ``n_mb`` its routed tokens and ``N`` the step's routed tokens
  summed over every data-parallel rank. So it does not depend on the number of data-parallel ranks, nor
  on how the micro-batches are spread over them; as in Hugging Face and Megatron-LM (whose aux loss is
  per micro-batch too) it does depend on the micro-batch size, since ``f_e * P_e`` is not a sum over tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import torch
    from torch import nn

#: The per-micro-batch metric: the micro-batch's share of the step's aux loss (summed over micro-batches and
#: data-parallel ranks it is the step's aux loss, without the coefficient).
METRIC = "moe_aux_loss"


class AuxLoss(NamedTuple):
    """One forward's aux loss before normalisation: ``value`` over ``tokens`` routed tokens, times ``coef``."""

    value: torch.Tensor
    tokens: float
    coef: float


def aux_coefficient(config: Any) -> float:
    """The coefficient the step's aux loss is trained with; 0 when the config does not ask for it."""
    if not getattr(config, "output_router_logits", False):
        return 0.0
    return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)


def routed_tokens(batch: Any) -> torch.Tensor:
    """Routed tokens of ``batch`` (float64): ``input_lengths`` summed over rows with ``sample_mask`` 1."""
    import torch

    return (batch["input_lengths"].double() * batch["sample_mask"].double()).sum().to(torch.float64)


def load_balancing_loss(router_logits: list[torch.Tensor], mask: torch.Tensor, top_k: int) -> torch.Tensor:
    """Hugging Face's load-balancing loss over the rows of ``router_logits`` (each ``[T, E]``, one per MoE layer)
    where the flat boolean ``mask`` ``[T]`` is true; computed in float32 or wider; 0 when no row counts."""
    import torch

    first = router_logits[0]
    dtype = torch.promote_types(first.dtype, torch.float32)
    experts = first.shape[-1]
    keep = mask.reshape(-1).to(first.device)
    assigned = torch.zeros(experts, dtype=dtype, device=first.device)
    prob_sum = torch.zeros(experts, dtype=dtype, device=first.device)
    for logits in router_logits:
        probs = torch.softmax(logits.to(dtype)[keep], dim=-1)
        chosen = torch.topk(probs, top_k, dim=-1).indices.reshape(-1)
        assigned = assigned + torch.bincount(chosen, minlength=experts).to(dtype)
        prob_sum = prob_sum + probs.sum(dim=0)
    # A tensor, not a host number: no device sync per micro-batch. With no routed row both sums are 0, so the
    # loss is 0 and its graph is kept (every rank runs the same backward).
    rows = (keep.sum() * len(router_logits)).clamp(min=1).to(dtype)
    return experts * torch.sum((assigned / rows) * (prob_sum / rows))


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The router of every sparse MoE block: the ``gate`` of each module holding both ``gate`` and ``experts``."""
    from torch import nn

    routers = [getattr(m, "gate", None) for m in model.modules() if hasattr(m, "experts")]
    return [r for r in routers if isinstance(r, nn.Module)]


class RouterLogitsRecorder:
    """Forward hooks on a model's routers that keep their logits while :meth:`recording` is open.

    Only inside the ``with``: an activation-checkpointed layer runs its routers again in backward,
    and those recomputed logits must not be counted twice."""

    def __init__(self, model: nn.Module) -> None:
        self.logits: list[torch.Tensor] = []
        self._on = False
        self._handles = [router.register_forward_hook(self._keep) for router in moe_routers(model)]

    def __bool__(self) -> bool:
        return bool(self._handles)

    def _keep(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._on:
            self.logits.append(output[0] if isinstance(output, tuple) else output)

    @contextmanager
    def recording(self) -> Iterator[list[torch.Tensor]]:
        self.logits = []
        self._on = True
        try:
            yield self.logits
        finally:
            self._on = False

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


__all__ = [
    "METRIC",
    "AuxLoss",
    "RouterLogitsRecorder",
    "aux_coefficient",
    "load_balancing_loss",
    "moe_routers",
    "routed_tokens",
]
