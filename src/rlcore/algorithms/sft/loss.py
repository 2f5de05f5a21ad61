"""SFT's loss: the negative log-likelihood of the trained tokens.

It implements :class:`rlcore.interfaces.loss.LossFunction` with the aggregation convention of
:mod:`rlcore.algorithms.grpo.loss` (divided by the step's global token count, summed by the caller), so any
backend's conformance kit and benchmarks use it as the plain training loss. Importing this module does not import
torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from rlcore.algorithms.utils import normalised_sum, valid_token_mask, zero_off_mask
from rlcore.interfaces.loss import LossType

if TYPE_CHECKING:
    import torch

__all__ = ["NLLLoss"]


class NLLLoss:
    """Negative log-likelihood for SFT: mean over all valid tokens of the step of ``-log pi``.

    Token-level normalisation by ``global_valid_toks`` (see the module
    docstring). Metrics: ``loss`` and ``num_valid_tokens`` (a raw count).
    """

    loss_type = LossType.TOKEN_LEVEL

    def __call__(
        self,
        logprobs: torch.Tensor,
        data: Mapping[str, Any],
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        mask = valid_token_mask(data, logprobs.device)
        lp = zero_off_mask(logprobs, mask)
        loss = normalised_sum(-lp, mask, self.loss_type, global_valid_seqs, global_valid_toks)
        return loss, {"loss": loss.detach(), "num_valid_tokens": mask.sum()}  # read once per step by the loop
