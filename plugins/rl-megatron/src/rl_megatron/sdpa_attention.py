"""megatron-core's core attention computed by ``torch.nn.functional.scaled_dot_product_attention``.

Without Transformer Engine, megatron-core's local layer spec computes
attention unfused: the ``[b, heads, s, s]`` scores are materialised in
float32, softmaxed and kept for backward. On CPU that made megatron's logprob
pass about half as fast as a Hugging Face model running sdpa and its
activations at 1024 tokens a third larger (``benchmarks/scaling.py``). This
subclass keeps ``DotProductAttention``'s constructor, parameters and
interface, and hands the computation to sdpa (a fused kernel on CPU and on
GPU). What sdpa cannot express (packed sequences, an attention bias, learned
softmax offsets) goes to megatron's own implementation.

Under context parallelism (:mod:`rl_megatron.context_parallel`) the queries are this CP rank's positions and the
keys and values are all-gathered over the CP group first; the mask the worker passes is then
``[b, 1, s_local, s]``, from global positions.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention


class SdpaDotProductAttention(DotProductAttention):
    """``DotProductAttention`` through sdpa: query ``[sq, b, np, hn]``, key/value ``[sk, b, ng, hn]``,
    ``attention_mask`` True where attention is *not* allowed; returns ``[sq, b, np * hn]``."""

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        cp_size = config.context_parallel_size
        if cp_size > 1:  # megatron's class refuses CP (only TransformerEngine's has it); this one gathers K/V
            config = copy.copy(config)
            config.context_parallel_size = 1
        super().__init__(config, *args, **kwargs)
        self.cp_group = None
        if cp_size > 1:
            from megatron.core import parallel_state

            self.cp_group = parallel_state.get_context_parallel_group()

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if packed_seq_params is not None or attention_bias is not None or self.softmax_offset is not None:
            if self.cp_group is not None:
                raise NotImplementedError(
                    "context parallelism with packed sequences, an attention bias or softmax offsets"
                )
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params)
        if self.cp_group is not None:
            from rl_megatron.context_parallel import gather_keys_values

            key, value = gather_keys_values(key, self.cp_group), gather_keys_values(value, self.cp_group)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, hn]
        context = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=None if attention_mask is None else ~attention_mask,
            is_causal=attention_mask is None,
            dropout_p=self.attention_dropout.p if self.training else 0.0,
            scale=self.softmax_scale,
            enable_gqa=k.size(1) != q.size(1),
        )
        return context.permute(2, 0, 1, 3).reshape(query.size(0), query.size(1), -1)
