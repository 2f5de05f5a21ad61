"""On-policy distillation's loss: a KL between the teacher's and the student's next-token distributions,
restricted to the teacher's top-k token ids.

A slot whose teacher logit is ``-inf`` is left out of both distributions (a cross-tokenizer teacher's entry with
no counterpart in the student's vocabulary: :mod:`rlcore.algorithms.distillation.token_mapping`); with every logit
finite the loss is the one below.

The teacher's top-k logits and ids come with the batch (``teacher_topk_logits`` and ``logit_indices``,
``[B, S, k]``, aligned like logprobs: position ``i`` scores the prediction of token ``i``). The teacher is
renormalised over its k ids (its logits are known nowhere else). The student's side is a loss input its backend
computes (:mod:`rlcore.training.loss_inputs`) from whole or tensor-parallel-split logits, so no rank ever holds
the full vocabulary for this loss:

- ``zero_outside_topk: false`` (NeMo-RL's default): ``logits_at_indices``, renormalised over the k ids too;
- ``zero_outside_topk: true``: ``logprobs_at_indices`` (the student's full-vocabulary logprobs, not
  renormalised) and, for a reverse or mixed KL, ``entropy`` (the student's full-vocabulary entropy ``H``). The
  reverse KL then also scores the student's mass outside the top-k, where the teacher is given log-probability
  ``LOG_INFINITESIMAL`` = -100 (NeMo-RL's ``log_infinitesimal``)::

      reverse += sum_{v outside} p_s(v) (log p_s(v) + 100)
              = (-H - sum_j p_s(j) log p_s(j)) + 100 (1 - sum_j p_s(j))

Then per token::

    forward = sum_j p_t(j) (log p_t(j) - log p_s(j))
    reverse = sum_j p_s(j) (log p_s(j) - log p_t(j))   [+ the term outside, above]
    mixed   = w forward + (1 - w) reverse          (w = mixed_kl_weight)

averaged over every valid token of the step (token level, the loss contract of :mod:`rlcore.interfaces.loss`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from rlcore.algorithms.distillation.config import DistillationLossConfig
from rlcore.algorithms.utils import normaliser, valid_token_mask, zero_off_mask
from rlcore.interfaces.loss import ENTROPY, LOGITS_AT_INDICES, LOGPROBS_AT_INDICES, LossType

if TYPE_CHECKING:
    import torch

#: Where a batch holds the teacher's top-k logits ([B, S, k], aligned like logprobs).
TEACHER_LOGITS_KEY = "teacher_topk_logits"
#: The teacher's log-probability outside its top-k under ``zero_outside_topk`` (NeMo-RL's ``log_infinitesimal``).
LOG_INFINITESIMAL = -100.0


class DistillationLossFn:
    """NeMo-RL's ``DistillationLossFn``: forward, reverse or mixed KL per token over the teacher's top-k, the
    student renormalised over it or (``zero_outside_topk``) scored over the whole vocabulary."""

    loss_type = LossType.TOKEN_LEVEL

    def __init__(self, cfg: DistillationLossConfig | Mapping[str, Any] | None = None) -> None:
        self.cfg = cfg if isinstance(cfg, DistillationLossConfig) else DistillationLossConfig(**(cfg or {}))
        if not self.cfg.zero_outside_topk:
            self.inputs: tuple[str, ...] = (LOGITS_AT_INDICES,)
        else:  # the entropy only enters the reverse KL (NeMo-RL computes it only then, too)
            self.inputs = (LOGPROBS_AT_INDICES,) + ((ENTROPY,) if self.cfg.kl_type != "forward" else ())

    def __call__(
        self,
        logprobs: torch.Tensor,
        data: Mapping[str, Any],
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        import torch

        for key in (*self.inputs, TEACHER_LOGITS_KEY):
            if key not in data:
                raise KeyError(f"DistillationLossFn needs data[{key!r}]")
        student_key = self.inputs[0]
        for key in (student_key, TEACHER_LOGITS_KEY):
            if data[key].shape[-1] == 0:  # what distillation.topk_logits_k refuses (NeMo-RL raises too)
                raise ValueError(
                    f"DistillationLossFn: data[{key!r}] has an empty top-k (k = 0), over which no KL "
                    "is defined; give the teacher's top k >= 1 logits (distillation.topk_logits_k)"
                )
        mask = valid_token_mask(data, logprobs.device)
        token = mask[..., None]
        student = torch.where(token, data[student_key].to(logprobs.device).float(), 0.0)
        teacher = torch.where(token, data[TEACHER_LOGITS_KEY].to(student.device).float().detach(), 0.0)
        slot = teacher > float("-inf")  # a teacher logit of -inf: an entry with no student counterpart, left out
        if not self.cfg.zero_outside_topk:
            student = torch.where(slot, student, float("-inf"))
        log_s = student if self.cfg.zero_outside_topk else torch.log_softmax(student, -1)
        log_s, log_t = torch.where(slot, log_s, 0.0), torch.where(slot, torch.log_softmax(teacher, -1), 0.0)
        p_s, p_t = torch.where(slot, log_s.exp(), 0.0), torch.where(slot, log_t.exp(), 0.0)
        forward = (p_t * (log_t - log_s)).sum(-1)
        reverse = (p_s * (log_s - log_t)).sum(-1)
        if ENTROPY in self.inputs:
            reverse = reverse + self._outside_topk(p_s, log_s, data[ENTROPY].to(student.device).float())
        w = {"forward": 1.0, "reverse": 0.0, "mixed": self.cfg.mixed_kl_weight}[self.cfg.kl_type]
        per_token = zero_off_mask(w * forward + (1.0 - w) * reverse, mask)
        loss = per_token.sum() / normaliser(global_valid_toks, per_token)
        tokens = normaliser(global_valid_toks, per_token)
        metrics = {
            "loss": loss.detach(),  # 0-dim tensors, read to the host once per step by the training loop
            "forward_kl": zero_off_mask(forward, mask).sum().detach() / tokens,
            "num_valid_tokens": mask.sum(),
        }
        if not self.cfg.zero_outside_topk or ENTROPY in self.inputs:  # a forward KL alone has no full reverse
            metrics["reverse_kl"] = zero_off_mask(reverse, mask).sum().detach() / tokens
        return loss, metrics

    @staticmethod
    def _outside_topk(p_s: torch.Tensor, log_s: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
        """The reverse KL's share outside the top-k: ``sum_outside p_s (log p_s - LOG_INFINITESIMAL)``, from the
        full-vocabulary entropy and the student's top-k probabilities and logprobs ``[B, S, k]`` (0 in a slot
        left out, which then counts as outside)."""
        plogp_rest = -entropy - (p_s * log_s).sum(-1)
        return plogp_rest - LOG_INFINITESIMAL * (1.0 - p_s.sum(-1))


__all__ = ["DistillationLossFn", "LOG_INFINITESIMAL", "TEACHER_LOGITS_KEY"]
