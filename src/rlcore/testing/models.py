"""Random training batches for tests; the tiny tokenizer/model builders now live in :mod:`rlcore.models`.

The builders (``build_tiny_tokenizer``, ``build_tiny_model``,
``tiny_model_path``, ...) are re-exported here, so test suites that import
them from ``rlcore.testing.models`` keep working. torch is imported inside
:func:`make_batch`.
"""

from __future__ import annotations

from typing import Any

from rlcore.models import (  # re-exported: the builders are production code, used by the kit
    ARCHS,
    BYTE_OFFSET,
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    build_tiny_model,
    build_tiny_tokenizer,
    default_cache_root,
    tiny_model_path,
)


def make_batch(
    tokenizer_or_vocab_size: Any,
    batch_size: int,
    min_len: int,
    max_len: int,
    seed: int = 0,
) -> dict:
    """A random, seeded, right-padded training batch.

    Returns a dict with
      - ``input_ids`` ``[B, S]`` int64, ``S`` = the longest sequence; padding
        is the tokenizer's pad id (0 for a plain vocab size);
      - ``input_lengths`` ``[B]`` int64, each in ``[min_len, max_len]``;
      - ``token_mask`` ``[B, S]`` float32: 1 on the "response" part, i.e.
        positions ``p <= i < length`` for a random prompt length
        ``1 <= p < length`` (so every sequence has >= 1 prompt and response token);
      - ``sample_mask`` ``[B]`` float32 ones.
    Token ids avoid the tokenizer's special tokens (any id in
    ``[0, vocab_size)`` for a plain vocab size). The global torch RNG is untouched.
    """
    import torch

    if min_len < 2 or max_len < min_len:
        raise ValueError(f"need 2 <= min_len <= max_len, got min_len={min_len}, max_len={max_len}")
    if isinstance(tokenizer_or_vocab_size, int):
        candidates = torch.arange(tokenizer_or_vocab_size)
        pad_id = 0
    else:
        tok = tokenizer_or_vocab_size
        special = set(tok.all_special_ids)
        candidates = torch.tensor([i for i in range(len(tok)) if i not in special])
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0

    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (batch_size,), generator=gen)
    seq_len = int(lengths.max())
    ids = candidates[torch.randint(len(candidates), (batch_size, seq_len), generator=gen)]
    # prompt length uniform in [1, length - 1]
    prompt_lens = 1 + (torch.rand(batch_size, generator=gen) * (lengths - 1)).long()

    positions = torch.arange(seq_len).unsqueeze(0)
    valid = positions < lengths.unsqueeze(1)
    input_ids = torch.where(valid, ids, torch.full_like(ids, pad_id))
    token_mask = (valid & (positions >= prompt_lens.unsqueeze(1))).float()
    return {
        "input_ids": input_ids.long(),
        "input_lengths": lengths.long(),
        "token_mask": token_mask,
        "sample_mask": torch.ones(batch_size, dtype=torch.float32),
    }


__all__ = [
    "ARCHS",
    "BYTE_OFFSET",
    "CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "build_tiny_model",
    "build_tiny_tokenizer",
    "default_cache_root",
    "make_batch",
    "tiny_model_path",
]
