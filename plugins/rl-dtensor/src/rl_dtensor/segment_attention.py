"""Attention over a packed row one sequence at a time, instead of through a dense block-diagonal mask.

A packed row of T tokens under a ``[T, T]`` mask makes sdpa compute and keep (for backward) T² scores
per head, most of them masked: with NeMo-RL's default budget (micro-batch size x max length, e.g.
16 x 384 = 6144 tokens) that is more attention work than the padding packing removes, and gigabytes
of scores per layer. Here each sequence's slice of the row goes through sdpa with ``is_causal``: the
cost is the sum of the squared lengths, never more than the padded batch's.

The function is registered as an HF attention implementation (with sdpa's mask function) and the
model is switched to it once. It splits only when the forward passes ``cu_seq_lens_q`` (a packed
micro-batch, :func:`rl_dtensor.inputs.packed_inputs`); every other forward is HF's own sdpa.
"""

from __future__ import annotations

from typing import Any

import torch

NAME = "rlcore_segment_sdpa"


def segment_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``query`` ``[1, heads, T, d]``, ``key``/``value`` ``[1, kv_heads, T, d]`` → ``[1, T, heads, d]``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if cu_seq_lens_q is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    gqa = getattr(module, "num_key_value_groups", 1) > 1
    bounds = cu_seq_lens_q.tolist()
    parts = [
        torch.nn.functional.scaled_dot_product_attention(
            query[:, :, a:b],
            key[:, :, a:b],
            value[:, :, a:b],
            dropout_p=dropout,
            scale=scaling,
            is_causal=True,
            enable_gqa=gqa,
        )
        for a, b in zip(bounds[:-1], bounds[1:])
    ]
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous(), None


def can_use_segment_attention(config: Any) -> bool:
    """Plain causal sdpa everywhere: no sliding window, no attention type other than full attention."""
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    sliding = getattr(config, "use_sliding_window", False) or (
        getattr(config, "sliding_window", None) is not None and not hasattr(config, "use_sliding_window")
    )
    return config._attn_implementation == "sdpa" and set(layer_types) == {"full_attention"} and not sliding


def use_segment_attention(model: torch.nn.Module) -> bool:
    """Switch ``model`` to :func:`segment_sdpa` when its attention allows; returns whether it did."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    if not can_use_segment_attention(model.config):
        return False
    AttentionInterface.register(NAME, segment_sdpa)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
    return model.config._attn_implementation == NAME
