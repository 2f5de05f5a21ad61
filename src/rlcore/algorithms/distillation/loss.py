"""On-policy distillation's loss: a KL between the teacher's and the student's next-token distributions,
restricted to the teacher's top-k token ids.

The teacher's top-k logits and ids come with the batch (``teacher_topk_logits`` and ``logit_indices``,
``[B, S, k]``, aligned like logprobs: position ``i`` scores the prediction of token ``i``). The student's
logits at those ids are a loss input the backend computes (``inputs = ("logits_at_indices",)``,
:mod:`rlcore.training.loss_inputs`), from whole or tensor-parallel-split logits, so no rank ever holds the
full vocabulary for this loss. Both sets of logits are renormalised over the k ids (NeMo-RL's default,
``zero_outside_topk: false``), then per token::

    forward = sum_j p_t(j) (log p_t(j) - log p_s(j))
    reverse = sum_j p_s(j) (log p_s(j) - log p_t(j))
    mixed   = w forward + (1 - w) reverse          (w = mixed_kl_weight)

averaged over every valid token of the step (token level, the loss contract of :mod:`rlcore.interfaces.loss`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from rlcore.algorithms.utils import normaliser, valid_token_mask, zero_off_mask
from rlcore.config.distillation import DistillationLossConfig
from rlcore.interfaces.loss import LOGITS_AT_INDICES, LossType

if TYPE_CHECKING:
    import torch

#: Where a batch holds the teacher's top-k logits ([B, S, k], aligned like logprobs).
TEACHER_LOGITS_KEY = "teacher_topk_logits"


class DistillationLossFn:
    """NeMo-RL's ``DistillationLossFn`` (top-k renormalised): forward, reverse or mixed KL per token."""

    loss_type = LossType.TOKEN_LEVEL
    inputs = (LOGITS_AT_INDICES,)

    def __init__(self, cfg: DistillationLossConfig | Mapping[str, Any] | None = None) -> None:
        self.cfg = cfg if isinstance(cfg, DistillationLossConfig) else DistillationLossConfig(**(cfg or {}))

    def __call__(
        self,
        logprobs: "torch.Tensor",
        data: Mapping[str, Any],
        global_valid_seqs: "torch.Tensor",
        global_valid_toks: "torch.Tensor",
    ) -> tuple["torch.Tensor", dict[str, float]]:
        import torch

        for key in (LOGITS_AT_INDICES, TEACHER_LOGITS_KEY):
            if key not in data:
                raise KeyError(f"DistillationLossFn needs data[{key!r}]")
        for key in (LOGITS_AT_INDICES, TEACHER_LOGITS_KEY):
            if data[key].shape[-1] == 0:  # what distillation.topk_logits_k refuses (NeMo-RL raises too)
                raise ValueError(f"DistillationLossFn: data[{key!r}] has an empty top-k (k = 0), over which no KL "
                                 "is defined; give the teacher's top k >= 1 logits (distillation.topk_logits_k)")
        mask = valid_token_mask(data, logprobs.device)
        token = mask[..., None]
        student = torch.where(token, data[LOGITS_AT_INDICES].float(), 0.0)
        teacher = torch.where(token, data[TEACHER_LOGITS_KEY].to(student.device).float().detach(), 0.0)
        log_s, log_t = torch.log_softmax(student, -1), torch.log_softmax(teacher, -1)
        forward = (log_t.exp() * (log_t - log_s)).sum(-1)
        reverse = (log_s.exp() * (log_s - log_t)).sum(-1)
        w = {"forward": 1.0, "reverse": 0.0, "mixed": self.cfg.mixed_kl_weight}[self.cfg.kl_type]
        per_token = zero_off_mask(w * forward + (1.0 - w) * reverse, mask)
        loss = per_token.sum() / normaliser(global_valid_toks, per_token)
        tokens = normaliser(global_valid_toks, per_token)
        return loss, {
            "loss": float(loss.detach()),
            "forward_kl": float(zero_off_mask(forward, mask).sum().detach() / tokens),
            "reverse_kl": float(zero_off_mask(reverse, mask).sum().detach() / tokens),
            "num_valid_tokens": float(mask.sum()),
        }


__all__ = ["DistillationLossFn", "TEACHER_LOGITS_KEY"]
