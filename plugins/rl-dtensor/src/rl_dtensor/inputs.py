"""Model inputs for one micro-batch, padded or packed, and the way back to ``[B, S]``.

Two layouts:

- padded (plain and dynamic batching): the right-padded ``[B, S]`` batch with
  a 2-D padding mask, exactly what a single-process HF forward gets;
- packed (sequence packing): every sequence's valid tokens back to back in one
  ``[1, T]`` row, ``position_ids`` restarting at 0 per sequence and an
  explicit 4-D block-diagonal causal mask. HF transformers can also infer
  packing from ``position_ids`` alone, but only when no mask is passed and, for
  the kernels that really avoid cross-sequence attention, only with flash
  attention on a GPU; an explicit mask works with the sdpa and eager
  implementations on any device (``create_causal_mask`` passes a 4-D mask
  through untouched).

A vision-language model's packed row gets each sequence's 3D rotary positions (:func:`forward_kwargs`); its
images go with it in row order, which is the packed order.

Under sequence parallel the sequence is split over tp ranks, so the width is
padded to a multiple of tp; the padding is cut off again when results are put
back in the ``[B, S]`` layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from rl_dtensor.vocab_parallel import entropy, gather_at, gather_logprobs, logprobs_at, topk
from rlcore.data.packing import PackedSequences, pack_microbatch, unpack_tokens
from rlcore.training.logprobs import align

if TYPE_CHECKING:
    from rlcore.training.vision import VisionForward


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass
class ModelInputs:
    """The tensors of one forward, and how to read next-token results back."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor
    input_lengths: torch.Tensor
    seq_len: int  # S of the caller's micro-batch
    packed: PackedSequences | None = None
    segment_bounds: torch.Tensor | None = None  # a packed row's segment starts + its width (segment attention)

    def model_kwargs(self) -> dict[str, Any]:
        kwargs = {
            "input_ids": self.input_ids,
            "attention_mask": self.attention_mask,
            "position_ids": self.position_ids,
            "use_cache": False,
        }
        if self.segment_bounds is not None:
            kwargs["cu_seq_lens_q"] = self.segment_bounds
        return kwargs

    def routed_mask(self, sample_mask: torch.Tensor) -> torch.Tensor:
        """``[rows, width]`` bool, true at the real tokens of rows whose ``sample_mask`` is 1: the tokens a
        mixture-of-experts' load-balancing loss counts (:mod:`rlcore.training.moe_aux`), in this forward's layout."""
        device, width = self.input_ids.device, self.input_ids.shape[1]
        if self.packed is None:
            real = torch.arange(width, device=device)[None, :] < self.input_lengths[:, None]
            return real & sample_mask.to(device).bool()[:, None]
        # Built on the host from the packing's own (host) bounds, then moved: no device sync.
        mask = torch.zeros(1, width, dtype=torch.bool)
        starts = self.packed.cu_seqlens.long().tolist()
        for b, (length, keep) in enumerate(zip(self.packed.input_lengths.tolist(), sample_mask.bool().tolist())):
            mask[0, starts[b] : starts[b] + length] = keep
        return mask.to(device)

    def _next_targets(self) -> torch.Tensor:
        """``target[:, t] = input_ids[:, t + 1]`` (the last column is a dummy 0)."""
        ids = self.input_ids
        return torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)

    def logprobs(self, logits: torch.Tensor, temperature: float = 1.0, chunk_size: int | None = None) -> torch.Tensor:
        """``[B, S]`` float32 token logprobs of ``softmax(logits / temperature)`` in the contract's alignment
        (design.md §2.2), ``chunk_size`` positions at a time when given."""
        next_lp = gather_logprobs(logits, self._next_targets(), temperature, chunk_size)  # column t predicts t + 1
        if self.packed is None:
            return align(next_lp[:, : self.seq_len - 1], self.input_lengths)
        p = self.packed
        width = int(p.cu_seqlens[-1])
        flat = torch.zeros(width, dtype=torch.float32, device=next_lp.device)
        flat[1:] = next_lp[0, : width - 1]
        # A sequence's first token has no context inside its sequence: 0 by contract.
        flat = torch.where(self.position_ids[0, :width] == 0, torch.zeros_like(flat), flat)
        return unpack_tokens(flat, p.cu_seqlens, p.batch_size, p.seq_len, p.input_lengths)

    def values(self, head_out: torch.Tensor) -> torch.Tensor:
        """``[B, S]`` float32 values of a value model's head output (``[B', W, 1]``), aligned like logprobs
        (:func:`rlcore.training.value_head.aligned_values`)."""
        from rlcore.training.value_head import aligned_values

        if self.packed is None:
            return aligned_values(head_out[:, : self.seq_len], self.input_lengths)
        return aligned_values(head_out, self.input_lengths, self.packed)

    def logits_at(self, logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """``[B, S, k]`` float32 logits at the aligned ids ``indices`` ``[B, S, k]`` (the ``logits_at_indices``
        loss input, :mod:`rlcore.training.loss_inputs`), in the same alignment."""
        return self._aligned(gather_at(logits, self._next_ids(indices)))

    def loss_input(self, name: str, logits: torch.Tensor, mb: Any) -> torch.Tensor:
        """The loss input ``name`` (:mod:`rlcore.training.loss_inputs`) of this forward's logits, aligned like
        logprobs: ``logits_at_indices``, ``logprobs_at_indices`` (``[B, S, k]``) or ``entropy`` (``[B, S]``)."""
        from rlcore.training.loss_inputs import ENTROPY, LOGIT_INDICES_KEY, LOGITS_AT_INDICES, LOGPROBS_AT_INDICES

        if name == ENTROPY:
            return self._aligned(entropy(logits)[..., None])[..., 0]
        if LOGIT_INDICES_KEY not in mb:
            raise KeyError(f"the loss asks for {name}, which needs data[{LOGIT_INDICES_KEY!r}] ([B, S, k] token ids)")
        at = {LOGITS_AT_INDICES: gather_at, LOGPROBS_AT_INDICES: logprobs_at}[name]
        return self._aligned(at(logits, self._next_ids(mb[LOGIT_INDICES_KEY])))

    def _next_ids(self, indices: torch.Tensor) -> torch.Tensor:
        """Aligned ids ``[B, S, k]`` laid out like the forward's columns: column ``t`` holds the ids scored by the
        logits at ``t`` (padded ``[B, W, k]``, or packed ``[1, W, k]``)."""
        width, k = self.input_ids.shape[1], indices.shape[-1]
        if self.packed is None:  # column t of the forward scores ids t + 1
            nxt = indices.new_zeros(indices.shape[0], width, k)
            nxt[:, : self.seq_len - 1] = indices[:, 1 : self.seq_len]
            return nxt.to(self.input_ids.device)
        starts = self.packed.cu_seqlens.long().tolist()
        nxt = indices.new_zeros(1, width, k)
        for b, length in enumerate(self.input_lengths.cpu().tolist()):
            nxt[0, starts[b] : starts[b] + length - 1] = indices[b, 1:length]
        return nxt.to(self.input_ids.device)

    def _aligned(self, values: torch.Tensor) -> torch.Tensor:
        """``[B', W, k]`` values at the forward's columns back to the caller's ``[B, S, k]`` in the logprob
        alignment (position 0 of each sequence and padding are 0)."""
        if self.packed is None:
            return align(values[:, : self.seq_len - 1], self.input_lengths)
        p = self.packed
        used = int(p.cu_seqlens[-1])
        flat = values.new_zeros(used, values.shape[-1])
        flat[1:] = values[0, : used - 1]
        first = (self.position_ids[0, :used] == 0)[:, None]  # a sequence's first token: 0 by contract
        flat = torch.where(first, torch.zeros_like(flat), flat)
        return unpack_tokens(flat, p.cu_seqlens, p.batch_size, p.seq_len, p.input_lengths)

    def topk(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k of the next-token positions, ``[B, S - 1, k]`` values and global indices."""
        values, indices = topk(logits, k)
        if self.packed is not None:
            p = self.packed
            width = int(p.cu_seqlens[-1])
            values = unpack_tokens(values[0, :width], p.cu_seqlens, p.batch_size, p.seq_len, p.input_lengths)
            indices = unpack_tokens(indices[0, :width], p.cu_seqlens, p.batch_size, p.seq_len, p.input_lengths)
        return values[:, : self.seq_len - 1], indices[:, : self.seq_len - 1]


def forward_kwargs(inputs: ModelInputs, mb: Any, vision: VisionForward | None) -> dict[str, Any]:
    """The model kwargs of a forward of ``inputs``. A vision-language model (``vision``) gets the rows' images,
    and derives its own positions, unless the rows are packed: then each sequence's 3D rotary positions are given
    (:meth:`rlcore.training.vision.VisionForward.packed_position_ids`)."""
    kwargs = inputs.model_kwargs()
    if vision is not None:
        kwargs.update(vision.kwargs(inputs.input_ids, mb))
        if inputs.packed is None:
            del kwargs["position_ids"]  # Qwen2.5-VL computes its 3D rotary positions from mm_token_type_ids
        else:
            kwargs["position_ids"] = vision.packed_position_ids(mb, inputs.position_ids)
    return kwargs


def padded_inputs(mb: Any, device: torch.device, multiple: int = 1) -> ModelInputs:
    """A right-padded micro-batch, widened to a multiple of ``multiple`` (sequence parallel)."""
    ids = mb["input_ids"]
    lengths = mb["input_lengths"].long()
    batch, seq_len = ids.shape
    width = _round_up(seq_len, multiple)
    if width != seq_len:
        ids = torch.cat([ids, ids.new_zeros(batch, width - seq_len)], dim=1)
    positions = torch.arange(width)
    mask = (positions[None, :] < lengths[:, None]).long()
    return ModelInputs(
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        position_ids=positions.expand(batch, width).to(device),
        input_lengths=lengths.to(device),
        seq_len=seq_len,
    )


def block_causal_mask(segments: torch.Tensor, attn_implementation: str, dtype: torch.dtype) -> torch.Tensor:
    """``[1, 1, T, T]`` mask letting each token see earlier tokens of its own segment only.

    Boolean (True = attend) for sdpa and the like; additive (0 / dtype min)
    for the eager implementation, which adds the mask to the scores.
    """
    width = segments.shape[0]
    causal = torch.ones(width, width, dtype=torch.bool, device=segments.device).tril()
    allowed = (segments[:, None] == segments[None, :]) & causal
    if attn_implementation == "eager":
        zero = torch.zeros((), dtype=dtype, device=segments.device)
        allowed = torch.where(allowed, zero, torch.finfo(dtype).min)
    return allowed[None, None]


def packed_inputs(
    mb: Any, device: torch.device, attn_implementation: str, dtype: torch.dtype, multiple: int = 1
) -> ModelInputs:
    """Pack a right-padded micro-batch into one row with a block-diagonal causal mask, or, for a model
    switched to segment attention (:mod:`rl_dtensor.segment_attention`), the segments' bounds instead.

    The row is padded to a multiple of ``multiple`` with a dummy segment of its own.
    """
    from rl_dtensor.segment_attention import NAME as SEGMENT_ATTENTION

    lengths = mb["input_lengths"].long()
    packed = pack_microbatch(mb["input_ids"], lengths)
    used = int(packed.cu_seqlens[-1])
    width = max(_round_up(used, multiple), multiple)
    tail = width - used
    ids = torch.cat([packed.input_ids, packed.input_ids.new_zeros(1, tail)], dim=1)
    positions = torch.cat([packed.position_ids, torch.arange(tail)[None, :]], dim=1)
    inputs = ModelInputs(
        input_ids=ids.to(device),
        attention_mask=None,
        position_ids=positions.to(device),
        input_lengths=lengths.to(device),
        seq_len=int(mb["input_ids"].shape[1]),
        packed=packed,
    )
    bounds = packed.cu_seqlens.long()
    if tail:
        bounds = torch.cat([bounds, torch.tensor([width])])  # the padding is a segment of its own
    if attn_implementation == SEGMENT_ATTENTION:
        inputs.segment_bounds = bounds
    else:
        seg_lens = bounds[1:] - bounds[:-1]
        segments = torch.repeat_interleave(torch.arange(len(seg_lens)), seg_lens)
        inputs.attention_mask = block_causal_mask(segments.to(device), attn_implementation, dtype)
    return inputs
