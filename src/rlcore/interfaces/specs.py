"""Typed shapes of the data that crosses the interfaces (design.md §2.1-2.2).

All sequence tensors are right-padded. Logprob-like outputs are ``[B, S]``
float32 aligned to the input: position 0 is 0, position ``i`` holds
``log p(token_i | tokens_<i)``, padding is 0.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, TypedDict

if sys.version_info >= (3, 11):
    from typing import NotRequired
else:  # Python 3.10: typing_extensions (a pydantic dependency) has it
    from typing_extensions import NotRequired

if TYPE_CHECKING:
    import torch


class GenerationDatumSpec(TypedDict):
    """Input of ``generate`` and of the logprob methods."""

    input_ids: torch.Tensor  # [B, S] int64, right-padded
    input_lengths: torch.Tensor  # [B] int64
    stop_strings: NotRequired[list[list[str] | None]]  # per-sample stop strings
    # [B] int64, optional: each request's sampling seed (rlcore.run.rollouts.sampling_seed). An engine that honours
    # it samples a request from a generator of its own seeded with it (vLLM: SamplingParams(seed=...)), so the same
    # request on the same weights gives the same completion; one that ignores it still works, but a resumed run
    # does not reproduce its rollouts (docs/reproducibility.md).
    sampling_seeds: NotRequired[torch.Tensor]


class GenerationOutputSpec(TypedDict):
    """Output of ``generate``: prompt and completion in one right-padded tensor."""

    output_ids: torch.Tensor  # [B, S_prompt_padded + max_new_tokens]
    generation_lengths: torch.Tensor  # [B] number of generated tokens
    unpadded_sequence_lengths: torch.Tensor  # [B] prompt length + generation length
    logprobs: torch.Tensor  # [B, S_out] float32, prompt positions and padding 0
    truncated: NotRequired[torch.Tensor]  # [B] bool, hit max_new_tokens without a stop


class LogprobOutputSpec(TypedDict):
    logprobs: torch.Tensor  # [B, S] float32


class ReferenceLogprobOutputSpec(TypedDict):
    reference_logprobs: torch.Tensor  # [B, S] float32


class ScoreOutputSpec(TypedDict):
    scores: torch.Tensor  # [B]


class TopkLogitsOutputSpec(TypedDict):
    """Top-k logits of next-token positions: ``S - 1`` rows per sequence.

    Row ``i`` holds the top-k logits predicting token ``i + 1`` and their
    global (not vocab-shard-local) token indices.
    """

    topk_logits: torch.Tensor  # [B, S - 1, k]
    topk_indices: torch.Tensor  # [B, S - 1, k] int64


#: The rows ``train`` steps on: ``input_ids``, ``input_lengths`` and whatever its loss reads (the loss's own keys).
TrainingBatch = dict[str, object]

#: ``{hf_name: (shape, dtype name)}`` of every tensor a refit sends, in send order (``rlcore.refit.RefitMetadata``).
RefitInfo = dict[str, tuple[tuple[int, ...], str]]
