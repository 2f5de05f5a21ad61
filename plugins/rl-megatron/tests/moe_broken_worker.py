"""A megatron worker whose expert-parallel combine is broken on purpose: the negative control of the MoE parity
test (test_megatron_moe.py), which must notice it. Test code only; imported inside the Ray worker processes."""

from __future__ import annotations

from typing import Any

import torch

from rl_megatron.worker import MegatronPolicyWorker


def _combine_without_exchange(self: Any, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """The reverse all-to-all with its exchange dropped: each rank keeps the outputs its own experts computed for
    its own tokens, and the tokens whose experts live on another rank get zeros (right shape, wrong numbers)."""
    if self.ep_size == 1:
        return hidden_states
    rank = torch.distributed.get_rank(self.ep_group)
    sent, received = [int(n) for n in self.input_splits], [int(n) for n in self.output_splits]
    mine = hidden_states[sum(received[:rank]) : sum(received[: rank + 1])]
    out = hidden_states.new_zeros(sum(sent), *hidden_states.shape[1:])
    start = sum(sent[:rank])
    return torch.cat([out[:start], mine, out[start + sent[rank] :]]) + 0.0 * hidden_states.sum()


class BrokenCombineWorker(MegatronPolicyWorker):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        from megatron.core.transformer.moe import token_dispatcher

        token_dispatcher.MoEAlltoAllTokenDispatcher.token_combine = _combine_without_exchange  # type: ignore[method-assign]
        super().__init__(*args, **kwargs)
