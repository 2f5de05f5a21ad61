"""``BatchedDataDict``: the batch container that crosses every interface.

A dict whose values are batch-major: torch tensors (dim 0 is the batch) or
lists (one entry per sample). Sequence tensors are right-padded ``[B, S, ...]``
(design.md §2.1).

Sharding and micro-batching (design.md §2.4-2.5) live here too:
:meth:`BatchedDataDict.shard_by_batch_size` splits a batch over data-parallel
ranks and records on each shard how it is cut into micro-batches; a backend
then walks the steps with :meth:`get_batch` and the micro-batches with one of
the ``make_microbatch_iterator*`` methods.

torch is never imported at module import time.
"""

from __future__ import annotations

import sys
from collections import UserDict
from typing import TYPE_CHECKING, Any, Generic, Iterator, Mapping, Sequence, TypeVar

from rlcore.data.dynamic_batching import balanced_assignment, plan_dynamic_microbatches, round_up
from rlcore.data.packing import pack_sequences

if TYPE_CHECKING:
    import torch

T = TypeVar("T")

_DYNAMIC_KEYS = {"max_tokens_per_microbatch", "sequence_length_round", "input_key", "input_lengths_key"}
_PACKING_KEYS = _DYNAMIC_KEYS | {"algorithm", "sequence_length_pad_multiple"}


def _is_tensor(x: Any) -> bool:
    # No tensor can exist unless torch was imported by someone already.
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _index_list(indices: Any) -> list[int]:
    if _is_tensor(indices):
        return [int(i) for i in indices.reshape(-1).tolist()]
    return [int(i) for i in indices]


def _check_args(name: str, args: dict, allowed: set[str]) -> dict:
    unknown = set(args) - allowed
    if unknown:
        raise ValueError(f"unknown {name} keys {sorted(unknown)}; valid keys: {sorted(allowed)}")
    if "max_tokens_per_microbatch" not in args:
        raise ValueError(f"{name} needs 'max_tokens_per_microbatch'")
    out = {"sequence_length_round": 1, "input_key": "input_ids", "input_lengths_key": "input_lengths"}
    out.update(args)
    if "sequence_length_pad_multiple" in out:  # NeMo-RL's name for it in sequence_packing_args
        multiple = out.pop("sequence_length_pad_multiple")
        if "sequence_length_round" in args and args["sequence_length_round"] != multiple:
            raise ValueError(f"{name}: sequence_length_round={args['sequence_length_round']} and "
                             f"sequence_length_pad_multiple={multiple} name the same setting; give one")
        out["sequence_length_round"] = multiple
    return out


class BatchedDataDict(UserDict, Generic[T]):
    """Dict of batch-major tensors / lists.

    Methods that select rows return a new ``BatchedDataDict`` (tensors are
    views or copies, never the caller's dict), except :meth:`reorder_data`,
    which works in place.

    Shards made by :meth:`shard_by_batch_size` carry metadata:

    - ``sample_indices``: for each row, its index in the batch that was
      sharded.
    - ``micro_batch_indices``: ``None`` (plain mode) or, per optimizer step,
      the ``(start, end)`` row ranges of that step's micro-batches (absolute
      row numbers in this shard).
    - ``micro_batch_lengths``: per step and micro-batch, the padded sequence
      length (dynamic batching) or the packed token count (packing).

    Selecting or reordering rows drops the micro-batch metadata (it would no
    longer describe the rows); :meth:`copy`, :meth:`to` and :meth:`get_batch`
    keep it.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.sample_indices: list[int] | None = None
        self.micro_batch_indices: list[list[tuple[int, int]]] | None = None
        self.micro_batch_lengths: list[list[int]] | None = None
        self.seq_key: str = "input_ids"
        self.lengths_key: str = "input_lengths"
        super().__init__(*args, **kwargs)

    # ------------------------------------------------------------------ basics
    @property
    def size(self) -> int:
        """Batch size: shared length of every value (0 when empty)."""
        sizes = {}
        for k, v in self.data.items():
            if _is_tensor(v):
                if v.dim() == 0:
                    raise ValueError(f"key {k!r} holds a 0-d tensor, which has no batch dimension")
                sizes[k] = int(v.shape[0])
            elif isinstance(v, (list, tuple)):
                sizes[k] = len(v)
            else:
                raise TypeError(f"key {k!r} holds a {type(v).__name__}; values must be tensors or lists")
        if len(set(sizes.values())) > 1:
            raise ValueError(f"inconsistent batch sizes across keys: {sizes}")
        return next(iter(sizes.values()), 0)

    def _new(self, data: dict[str, Any], keep_meta: bool = False) -> "BatchedDataDict[T]":
        out: BatchedDataDict[T] = type(self)(data)
        out.seq_key, out.lengths_key = self.seq_key, self.lengths_key
        if keep_meta:
            out.sample_indices = None if self.sample_indices is None else list(self.sample_indices)
            out.micro_batch_indices = self.micro_batch_indices
            out.micro_batch_lengths = self.micro_batch_lengths
        return out

    def copy(self) -> "BatchedDataDict[T]":
        """Shallow copy: new dict and metadata, same tensor objects."""
        return self._new(dict(self.data), keep_meta=True)

    def to(self, device: "str | torch.device") -> "BatchedDataDict[T]":
        """In place, as in NeMo-RL: every tensor moved to ``device`` (lists unchanged); returns ``self``."""
        for key, value in self.data.items():
            if _is_tensor(value):
                self.data[key] = value.to(device)
        return self

    @classmethod
    def from_batches(
        cls, batches: Sequence[dict[str, Any]], pad_value_dict: dict[str, int] | None = None
    ) -> "BatchedDataDict[Any]":
        """Concatenate batches along dim 0.

        Tensors (dim >= 2) whose dim 1 differ are right-padded to the longest
        with ``pad_value_dict[key]`` (default 0); lists are concatenated. Every
        non-empty batch must have every key; an empty batch (no rows, as a dp
        rank with nothing to do returns) may lack keys, as in NeMo-RL.
        """
        batches = list(batches)
        keys = list(dict.fromkeys(k for b in batches for k in b))
        for k in keys:
            missing = [n for n, b in enumerate(batches) if k not in b and _num_rows(b)]
            if missing:
                raise KeyError(f"key {k!r} is missing from non-empty batches {missing}")
        batches = [b for b in batches if _num_rows(b) or set(b) >= set(keys)]
        if not batches:
            return cls()
        pads = pad_value_dict or {}
        out: dict[str, Any] = {}
        for k in keys:
            vals = [b[k] for b in batches]
            if all(_is_tensor(v) for v in vals):
                import torch

                if vals[0].dim() >= 2:
                    width = max(v.shape[1] for v in vals)
                    vals = [_fit_dim1(v, width, pads.get(k, 0)) for v in vals]
                out[k] = torch.cat(vals, dim=0)
            elif all(isinstance(v, (list, tuple)) for v in vals):
                out[k] = [x for v in vals for x in v]
            else:
                raise TypeError(f"key {k!r} mixes tensors and lists across batches")
        return cls(out)

    @classmethod
    def from_shards(
        cls,
        shard_results: Sequence[dict[str, Any]],
        sorted_indices: Sequence[int] | None = None,
        pad_value_dict: dict[str, int] | None = None,
    ) -> "BatchedDataDict[Any]":
        """Concatenate per-shard results and put rows back in the caller's order.

        ``sorted_indices`` is the second value :meth:`shard_by_batch_size`
        returned (row ``j`` of the concatenated shards is sample
        ``sorted_indices[j]`` of the original batch); ``None`` keeps the
        concatenation order.
        """
        out = cls.from_batches(shard_results, pad_value_dict)
        if sorted_indices is not None:
            out.reorder_data(sorted_indices)
        return out

    # ------------------------------------------------------------- row access
    def slice(self, start: int, end: int) -> "BatchedDataDict[T]":
        """Rows ``start:end`` (tensor views, list copies)."""
        out = self._new({k: v[start:end] for k, v in self.data.items()})
        if self.sample_indices is not None:
            out.sample_indices = self.sample_indices[start:end]
        return out

    def select_indices(self, indices: "Sequence[int] | torch.Tensor") -> "BatchedDataDict[T]":
        """Rows ``indices`` in that order (repeats allowed)."""
        idx = _index_list(indices)
        data: dict[str, Any] = {}
        for k, v in self.data.items():
            if _is_tensor(v):
                import torch

                data[k] = v[torch.tensor(idx, dtype=torch.long, device=v.device)]
            else:
                data[k] = [v[i] for i in idx]
        out = self._new(data)
        if self.sample_indices is not None:
            out.sample_indices = [self.sample_indices[i] for i in idx]
        return out

    def reorder_data(self, indices: "Sequence[int] | torch.Tensor") -> None:
        """In place: the old row ``j`` moves to position ``indices[j]``; returns None.

        NeMo-RL's meaning, so ``reorder_data(sorted_indices)`` undoes
        :meth:`shard_by_batch_size`'s order. ``indices`` must be a permutation
        of ``range(size)``; :meth:`select_indices` is the other direction.
        """
        idx = _index_list(indices)
        if sorted(idx) != list(range(self.size)):
            raise ValueError(f"reorder_data needs a permutation of range({self.size})")
        moved = self.select_indices(invert_permutation(idx))
        self.data = moved.data
        self.sample_indices = moved.sample_indices
        self.micro_batch_indices = None
        self.micro_batch_lengths = None

    def repeat_interleave(self, n: int) -> "BatchedDataDict[T]":
        """Each sample repeated ``n`` times consecutively (a,a,b,b for n=2).

        List items (a message log, a dict of metadata) are deep copies, as in NeMo-RL: a rollout that
        appends to one repeat's message log must not change its siblings'.
        """
        import copy

        if n < 1:
            raise ValueError(f"repeat_interleave needs n >= 1, got {n}")
        out = self.select_indices([i for i in range(self.size) for _ in range(n)])
        for key, value in out.data.items():
            if not _is_tensor(value):
                out.data[key] = [copy.deepcopy(item) for item in value]
        return out

    def chunk(self, n: int) -> "list[BatchedDataDict[T]]":
        """``n`` contiguous chunks whose sizes differ by at most one."""
        if n < 1:
            raise ValueError(f"chunk needs n >= 1, got {n}")
        q, r = divmod(self.size, n)
        out, start = [], 0
        for c in range(n):
            end = start + q + (1 if c < r else 0)
            out.append(self.slice(start, end))
            start = end
        return out

    # ---------------------------------------------------------------- sharding
    def shard_by_batch_size(
        self,
        shards: int,
        batch_size: int | None = None,
        dynamic_batching_args: dict[str, Any] | None = None,
        sequence_packing_args: dict[str, Any] | None = None,
    ) -> "list[BatchedDataDict[T]] | tuple[list[BatchedDataDict[T]], list[int]]":
        """Split into ``shards`` data-parallel shards, step by step.

        The batch is cut into consecutive global batches of ``batch_size``
        samples (one optimizer step each; default: the whole batch is one
        step) and every step is split across the shards, so shard ``r`` holds
        its part of step 0, then of step 1, ... Both the batch size and
        ``batch_size`` must divide evenly (``size % batch_size == 0``,
        ``batch_size % shards == 0``).

        Modes and return values:

        - plain: returns ``list[BatchedDataDict]``. Shard ``r`` of step ``k``
          is the contiguous rows ``k*bs + r*bs/shards ... + bs/shards``.
          ``micro_batch_indices`` is ``None``; iterate with
          :meth:`make_microbatch_iterator`.
        - dynamic batching (``dynamic_batching_args``: ``max_tokens_per_microbatch``,
          optional ``sequence_length_round`` (1), ``input_key``
          ("input_ids"), ``input_lengths_key`` ("input_lengths")): returns
          ``(shards, sorted_indices)``. Each step's samples are dealt to the
          shards by length (:func:`balanced_assignment`), so every shard
          still has ``bs/shards`` samples per step, then planned with
          :func:`plan_dynamic_microbatches`: same micro-batch count on every
          shard, each micro-batch within the token budget. Iterate with
          :meth:`make_microbatch_iterator_with_dynamic_shapes`.
        - sequence packing (``sequence_packing_args``: the same keys plus
          ``algorithm``, default "modified_first_fit_decreasing";
          ``max_tokens_per_microbatch`` is the bin capacity and
          ``sequence_length_round`` pads each sequence's length for the
          capacity check): returns ``(shards, sorted_indices)``. Each step's
          samples are packed into a number of bins that is a multiple of
          ``shards`` and the bins are dealt out, so every shard gets the same
          number of bins per step (its sample count may differ). Iterate with
          :meth:`make_microbatch_iterator_for_packable_sequences`.

        ``sorted_indices[j]`` is the original index of row ``j`` of the
        shards concatenated in order (``shards[0]`` rows first). Restore the
        caller's order with ``BatchedDataDict.from_shards(results,
        sorted_indices)``. In every mode ``shard.sample_indices`` gives the
        original index of each of its rows.
        """
        if dynamic_batching_args is not None and sequence_packing_args is not None:
            raise ValueError("dynamic batching and sequence packing are mutually exclusive")
        total = self.size
        if total == 0:
            raise ValueError("cannot shard an empty batch")
        bs = total if batch_size is None else int(batch_size)
        if shards < 1:
            raise ValueError(f"shards must be >= 1, got {shards}")
        if bs < 1 or total % bs:
            raise ValueError(f"batch of {total} samples is not a whole number of global batches of {batch_size}")
        if bs % shards:
            raise ValueError(
                f"global batch of {bs} samples cannot be split evenly over {shards} data-parallel "
                "shards; pad the batch (e.g. with sample_mask=0 rows) to a multiple of the dp size"
            )

        if dynamic_batching_args is not None:
            args = _check_args("dynamic_batching_args", dynamic_batching_args, _DYNAMIC_KEYS)
        elif sequence_packing_args is not None:
            args = _check_args("sequence_packing_args", sequence_packing_args, _PACKING_KEYS)
            args.setdefault("algorithm", "modified_first_fit_decreasing")
        else:
            args = None

        rows: list[list[int]] = [[] for _ in range(shards)]
        ranges: list[list[list[tuple[int, int]]]] = [[] for _ in range(shards)]
        lens_meta: list[list[list[int]]] = [[] for _ in range(shards)]
        lengths = None if args is None else _index_list(self.data[args["input_lengths_key"]])
        for k in range(total // bs):
            step = list(range(k * bs, (k + 1) * bs))
            if args is None:
                per = bs // shards
                for r in range(shards):
                    rows[r] += step[r * per : (r + 1) * per]
                continue
            assert lengths is not None
            if dynamic_batching_args is not None:
                seq = self.data.get(args["input_key"])
                width = int(seq.shape[1]) if _is_tensor(seq) and seq.dim() >= 2 else None
                groups = self._plan_dynamic_step(step, lengths, shards, args, width)
            else:
                groups = self._plan_packed_step(step, lengths, shards, args)
            for r, (mbs, mb_lens) in enumerate(groups):
                step_ranges = []
                for mb in mbs:
                    step_ranges.append((len(rows[r]), len(rows[r]) + len(mb)))
                    rows[r] += mb
                ranges[r].append(step_ranges)
                lens_meta[r].append(mb_lens)

        out = []
        for r in range(shards):
            shard = self.select_indices(rows[r])
            shard.sample_indices = list(rows[r])
            if args is not None:
                shard.seq_key = args["input_key"]
                shard.lengths_key = args["input_lengths_key"]
                shard.micro_batch_indices = ranges[r]
                shard.micro_batch_lengths = lens_meta[r]
            out.append(shard)
        if args is None:
            return out
        return out, [i for r in range(shards) for i in rows[r]]

    @staticmethod
    def _plan_dynamic_step(
        step: list[int], lengths: list[int], shards: int, args: dict, width: int | None
    ) -> list[tuple[list[list[int]], list[int]]]:
        """Per shard: micro-batches (original indices) and padded lengths (rounded, at most ``width``)."""
        budget = int(args["max_tokens_per_microbatch"])
        rnd = int(args["sequence_length_round"])
        for i in step:
            if round_up(lengths[i], rnd, width) > budget:
                raise ValueError(
                    f"sample {i} has length {lengths[i]} (rounded to a multiple of {rnd}), more "
                    f"than max_tokens_per_microbatch={budget}"
                )
        dealt = balanced_assignment([lengths[i] for i in step], shards)
        members = [[step[j] for j in d] for d in dealt]
        plans = plan_dynamic_microbatches(
            [[lengths[i] for i in m] for m in members], budget, rnd, max_length=width
        )
        return [
            ([[m[j] for j in mb] for mb in p.micro_batches], p.padded_lengths)
            for m, p in zip(members, plans)
        ]

    @staticmethod
    def _plan_packed_step(
        step: list[int], lengths: list[int], shards: int, args: dict
    ) -> list[tuple[list[list[int]], list[int]]]:
        """Per shard: bins (original indices) and their packed token counts."""
        cap = int(args["max_tokens_per_microbatch"])
        rnd = int(args["sequence_length_round"])
        # Ceil to the multiple, 0 stays 0: what pack_microbatch(pad_to_multiple=rnd) allocates.
        step_lens = [-(-lengths[i] // rnd) * rnd for i in step]
        for i, n in zip(step, step_lens):
            if n > cap:
                raise ValueError(
                    f"sample {i} has length {lengths[i]}"
                    + (f" (rounded to {n})" if n != lengths[i] else "")
                    + f", longer than the packing capacity max_tokens_per_microbatch={cap}"
                )
        bins = pack_sequences(
            step_lens, cap, args["algorithm"], min_bin_count=shards, bin_count_multiple=shards
        )
        loads = [sum(step_lens[j] for j in b) for b in bins]
        # Deal bins heaviest first in snake order so the shards' token totals match.
        dealt = balanced_assignment(loads, shards)
        return [
            ([[step[j] for j in bins[b]] for b in d], [loads[b] for b in d]) for d in dealt
        ]

    # ----------------------------------------------------- steps / micro-batches
    @property
    def num_steps(self) -> int | None:
        """Number of optimizer steps recorded by sharding (None in plain mode)."""
        return None if self.micro_batch_indices is None else len(self.micro_batch_indices)

    def get_batch(self, batch_idx: int, batch_size: int | None = None) -> "BatchedDataDict[T]":
        """Rows of optimizer step ``batch_idx`` of this shard.

        With micro-batch metadata (dynamic batching / packing) the step's rows
        come from it (steps may differ in size when packing) and the result
        carries that step's metadata only. In plain mode pass ``batch_size``
        (the per-shard step size, ``gbs // dp``).
        """
        if self.micro_batch_indices is None:
            if batch_size is None:
                raise ValueError("get_batch needs batch_size for data without micro-batch metadata")
            return self.slice(batch_idx * batch_size, (batch_idx + 1) * batch_size)
        assert self.micro_batch_lengths is not None
        ranges = self.micro_batch_indices[batch_idx]
        start, end = ranges[0][0], ranges[-1][1]
        out = self.slice(start, end)
        out.micro_batch_indices = [[(a - start, b - start) for a, b in ranges]]
        out.micro_batch_lengths = [list(self.micro_batch_lengths[batch_idx])]
        return out

    def make_microbatch_iterator(self, microbatch_size: int) -> "Iterator[BatchedDataDict[T]]":
        """Consecutive slices of ``microbatch_size`` rows (the last may be shorter)."""
        if microbatch_size < 1:
            raise ValueError(f"microbatch_size must be >= 1, got {microbatch_size}")
        for start in range(0, self.size, microbatch_size):
            yield self.slice(start, min(start + microbatch_size, self.size))

    def get_microbatch_iterator_len(self, microbatch_size: int) -> int:
        return -(-self.size // microbatch_size)

    def _planned(self, mode: str) -> Iterator[tuple[int, int, int]]:
        if self.micro_batch_indices is None or self.micro_batch_lengths is None:
            raise ValueError(
                f"{mode} needs micro-batch metadata: shard with shard_by_batch_size(..., "
                f"{'dynamic_batching_args' if mode == 'dynamic batching' else 'sequence_packing_args'}=...)"
            )
        for ranges, lens in zip(self.micro_batch_indices, self.micro_batch_lengths):
            for (a, b), n in zip(ranges, lens):
                yield a, b, n

    def make_microbatch_iterator_with_dynamic_shapes(self) -> "Iterator[BatchedDataDict[T]]":
        """Dynamic-batching micro-batches, over all steps of this dict in order.

        Each yielded micro-batch has its sequence tensors (every tensor whose
        dim 1 equals that of ``input_key``) cut, or zero-padded, to the
        micro-batch's planned padded length.
        """
        width = self._seq_width()
        for a, b, n in self._planned("dynamic batching"):
            yield self.slice(a, b)._fit_seq_dim(width, n)

    def get_microbatch_iterator_dynamic_shapes_len(self) -> int:
        return sum(1 for _ in self._planned("dynamic batching"))

    def make_microbatch_iterator_for_packable_sequences(self) -> "Iterator[BatchedDataDict[T]]":
        """Packing micro-batches (one per bin), over all steps in order.

        Each micro-batch is still right-padded ``[b, s]`` (cut to its longest
        sequence); the backend packs it with
        :func:`rlcore.data.packing.pack_microbatch`.
        """
        width = self._seq_width()
        for a, b, _ in self._planned("sequence packing"):
            mb = self.slice(a, b)
            lens = mb.data.get(self.lengths_key)
            if lens is not None and width is not None:
                mb = mb._fit_seq_dim(width, max(_index_list(lens), default=0))
            yield mb

    def get_microbatch_iterator_for_packable_sequences_len(self) -> int:
        return sum(1 for _ in self._planned("sequence packing"))

    def _seq_width(self) -> int | None:
        v = self.data.get(self.seq_key)
        return int(v.shape[1]) if _is_tensor(v) and v.dim() >= 2 else None

    def _fit_seq_dim(self, width: int | None, length: int) -> "BatchedDataDict[T]":
        """Cut or zero-pad dim 1 of the sequence tensors from ``width`` to ``length``."""
        if width is None or length == width:
            return self
        for k, v in self.data.items():
            if _is_tensor(v) and v.dim() >= 2 and v.shape[1] == width:
                self.data[k] = _fit_dim1(v, length, 0)
        return self


def _fit_dim1(t: "torch.Tensor", length: int, pad_value: Any) -> "torch.Tensor":
    if t.shape[1] >= length:
        return t[:, :length]
    pad = t.new_full((t.shape[0], length - t.shape[1]) + tuple(t.shape[2:]), pad_value)
    import torch

    return torch.cat([t, pad], dim=1)


def _num_rows(batch: Mapping[str, Any]) -> int:
    """Rows of a plain batch dict: the length of its first value (0 for an empty dict)."""
    value = next(iter(batch.values()), None)
    if value is None:
        return 0
    return int(value.shape[0]) if _is_tensor(value) else len(value)


def invert_permutation(indices: Sequence[int]) -> list[int]:
    """``inv`` with ``inv[indices[j]] == j``."""
    inv = [0] * len(indices)
    for j, i in enumerate(indices):
        inv[int(i)] = j
    return inv
