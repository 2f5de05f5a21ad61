"""``BatchedDataDict``: the batch container that crosses every interface.

A dict whose values are batch-major: torch tensors (dim 0 is the batch) or
lists (one entry per sample). Sequence tensors are right-padded ``[B, S, ...]``
(design.md §2.1).

Sharding and micro-batching (design.md §2.4-2.5) live here too:
:meth:`BatchedDataDict.shard_by_batch_size` splits a batch over data-parallel
ranks and records on each shard how it is cut into micro-batches (the plan
comes from :mod:`rlcore.data.step_plans`); a backend then walks the steps with
:meth:`get_batch` and the micro-batches with one of the
``make_microbatch_iterator*`` methods.

Rows may come in groups that must stay together (``group_size``, e.g. DPO's
chosen/rejected pairs): sharding and every micro-batch plan then move whole
groups, so a group always lands on one rank, in one step and in one
micro-batch, with its rows consecutive and in their original order.

torch is never imported at module import time.
"""

from __future__ import annotations

import sys
from collections import UserDict
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from rlcore.data.step_plans import check_step_split, plan_args, plan_shards

if TYPE_CHECKING:
    import torch

T = TypeVar("T")


def _is_tensor(x: Any) -> bool:
    # No tensor can exist unless torch was imported by someone already.
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _index_list(indices: Any) -> list[int]:
    if _is_tensor(indices):
        return [int(i) for i in indices.reshape(-1).tolist()]
    return [int(i) for i in indices]


def _whole_groups(indices: Sequence[int], group_size: int) -> bool:
    """Whether ``indices`` selects whole groups of ``group_size`` consecutive rows, each in its own order."""
    g = group_size
    if g == 1:
        return True
    if isinstance(indices, range) and indices.step == 1:
        return indices.start % g == 0 and len(indices) % g == 0
    if len(indices) % g:
        return False
    return all(
        indices[k] % g == 0 and all(indices[k + j] == indices[k] + j for j in range(1, g))
        for k in range(0, len(indices), g)
    )


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
    - ``group_size`` (default 1): rows ``g*k .. g*k+g-1`` form a group that
      must stay together (DPO sets 2: row ``2i`` is a chosen response, row
      ``2i+1`` its rejected one). The caller sets it on the batch it hands to
      ``Policy`` (``batch.group_size = 2``); :meth:`shard_by_batch_size` then
      never splits a group across ranks, steps or micro-batches, and
      :meth:`make_microbatch_iterator` refuses a micro-batch size that is not
      a multiple of it. It travels with the shards (workers need no change).

    Selecting or reordering rows drops the micro-batch metadata (it would no
    longer describe the rows); :meth:`copy`, :meth:`to` and :meth:`get_batch`
    keep it. ``group_size`` survives any selection of whole groups in their
    own order (:meth:`slice` on group boundaries, a shard, a micro-batch);
    any other selection gets 1.
    """

    #: Class default, so that a dict pickled before the attribute existed still has it.
    group_size: int = 1

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.sample_indices: list[int] | None = None
        self.micro_batch_indices: list[list[tuple[int, int]]] | None = None
        self.micro_batch_lengths: list[list[int]] | None = None
        self.seq_key: str = "input_ids"
        self.lengths_key: str = "input_lengths"
        self.group_size = 1
        super().__init__(*args, **kwargs)

    # ------------------------------------------------------------------ pickling
    def __getstate__(self) -> dict[str, Any]:
        """The batch as it crosses processes: its CPU tensors as numpy arrays (:mod:`rlcore.data.wire` says
        why), its metadata as is."""
        from rlcore.data.wire import to_wire

        return {**self.__dict__, "data": {key: to_wire(value) for key, value in self.data.items()}}

    def __setstate__(self, state: dict[str, Any]) -> None:
        from rlcore.data.wire import from_wire

        self.__dict__.update(state)
        self.data = {key: from_wire(value) for key, value in state["data"].items()}

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

    def _new(
        self, data: dict[str, Any], keep_meta: bool = False, rows: Sequence[int] | None = None
    ) -> BatchedDataDict[T]:
        """A dict of ``data``; with ``keep_meta`` all metadata, else the group size only if ``rows`` (the
        selected row numbers) are whole groups."""
        out: BatchedDataDict[T] = type(self)(data)
        out.seq_key, out.lengths_key = self.seq_key, self.lengths_key
        if keep_meta or (rows is not None and _whole_groups(rows, self.group_size)):
            out.group_size = self.group_size
        if keep_meta:
            out.sample_indices = None if self.sample_indices is None else list(self.sample_indices)
            out.micro_batch_indices = self.micro_batch_indices
            out.micro_batch_lengths = self.micro_batch_lengths
        return out

    def copy(self) -> BatchedDataDict[T]:
        """Shallow copy: new dict and metadata, same tensor objects."""
        return self._new(dict(self.data), keep_meta=True)

    def to(self, device: str | torch.device) -> BatchedDataDict[T]:
        """In place, as in NeMo-RL: every tensor moved to ``device`` (lists unchanged); returns ``self``."""
        for key, value in self.data.items():
            if _is_tensor(value):
                self.data[key] = value.to(device)
        return self

    @classmethod
    def from_batches(
        cls, batches: Sequence[dict[str, Any]], pad_value_dict: dict[str, int] | None = None
    ) -> BatchedDataDict[Any]:
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
        # Whole groups concatenated are whole groups.
        group_sizes = {getattr(b, "group_size", 1) for b in batches if _num_rows(b)}
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
        result = cls(out)
        if len(group_sizes) == 1:
            result.group_size = group_sizes.pop()
        return result

    @classmethod
    def from_shards(
        cls,
        shard_results: Sequence[dict[str, Any]],
        sorted_indices: Sequence[int] | None = None,
        pad_value_dict: dict[str, int] | None = None,
    ) -> BatchedDataDict[Any]:
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
    def slice(self, start: int, end: int) -> BatchedDataDict[T]:
        """Rows ``start:end`` (tensor views, list copies)."""
        out = self._new({k: v[start:end] for k, v in self.data.items()}, rows=range(self.size)[start:end])
        if self.sample_indices is not None:
            out.sample_indices = self.sample_indices[start:end]
        return out

    def select_indices(self, indices: Sequence[int] | torch.Tensor) -> BatchedDataDict[T]:
        """Rows ``indices`` in that order (repeats allowed)."""
        idx = _index_list(indices)
        data: dict[str, Any] = {}
        for k, v in self.data.items():
            if _is_tensor(v):
                import torch

                data[k] = v[torch.tensor(idx, dtype=torch.long, device=v.device)]
            else:
                data[k] = [v[i] for i in idx]
        out = self._new(data, rows=idx)
        if self.sample_indices is not None:
            out.sample_indices = [self.sample_indices[i] for i in idx]
        return out

    def reorder_data(self, indices: Sequence[int] | torch.Tensor) -> None:
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
        self.group_size = moved.group_size
        self.micro_batch_indices = None
        self.micro_batch_lengths = None

    def repeat_interleave(self, n: int) -> BatchedDataDict[T]:
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

    def chunk(self, n: int) -> list[BatchedDataDict[T]]:
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
        group_size: int | None = None,
    ) -> list[BatchedDataDict[T]] | tuple[list[BatchedDataDict[T]], list[int]]:
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

        Groups (``group_size``, default this dict's ``group_size``): every
        mode moves whole groups of ``g`` consecutive rows. Plain mode needs
        ``batch_size`` to be a multiple of ``g * shards`` (each shard's part
        of a step is then whole groups) and the workers' micro-batch size a
        multiple of ``g`` (:meth:`make_microbatch_iterator` checks it).
        Dynamic batching deals and plans groups as units (a group is as long
        as its longest row and counts ``g`` rows against the budget), so
        ``batch_size`` must be a multiple of ``g * shards`` too; packing
        packs each group's rows into one bin (its length is their sum), so
        ``batch_size`` must be a multiple of ``g``. A group's rows stay
        consecutive and in order in its micro-batch, and every shard carries
        ``group_size``.
        """
        # The plan (rows per shard, micro-batch ranges and lengths) is made in rlcore.data.step_plans.
        total = self.size
        bs, g = check_step_split(
            total,
            batch_size,
            shards,
            self.group_size if group_size is None else group_size,
            dynamic_batching_args,
            sequence_packing_args,
        )
        args = plan_args(dynamic_batching_args, sequence_packing_args)
        lengths = None if args is None else _index_list(self.data[args["input_lengths_key"]])
        seq = None if args is None else self.data.get(args["input_key"])
        width = int(seq.shape[1]) if _is_tensor(seq) and seq.dim() >= 2 else None
        plans = plan_shards(total, bs, shards, g, args, sequence_packing_args is not None, lengths, width)
        out = []
        for plan in plans:
            shard = self.select_indices(plan.rows)
            shard.sample_indices = list(plan.rows)
            shard.group_size = g
            if args is not None:
                shard.seq_key = args["input_key"]
                shard.lengths_key = args["input_lengths_key"]
                shard.micro_batch_indices = plan.micro_batch_indices
                shard.micro_batch_lengths = plan.micro_batch_lengths
            out.append(shard)
        if args is None:
            return out
        return out, [i for plan in plans for i in plan.rows]

    # ----------------------------------------------------- steps / micro-batches
    @property
    def num_steps(self) -> int | None:
        """Number of optimizer steps recorded by sharding (None in plain mode)."""
        return None if self.micro_batch_indices is None else len(self.micro_batch_indices)

    def get_batch(self, batch_idx: int, batch_size: int | None = None) -> BatchedDataDict[T]:
        """Rows of optimizer step ``batch_idx`` of this shard.

        With micro-batch metadata (dynamic batching / packing) the step's rows
        come from it (steps may differ in size when packing) and the result
        carries that step's metadata only. In plain mode pass ``batch_size``
        (the per-shard step size, ``gbs // dp``).
        """
        if self.micro_batch_indices is None:
            if batch_size is None:
                raise ValueError("get_batch needs batch_size for data without micro-batch metadata")
            self._check_group_multiple("get_batch: batch_size", batch_size)
            return self.slice(batch_idx * batch_size, (batch_idx + 1) * batch_size)
        assert self.micro_batch_lengths is not None
        ranges = self.micro_batch_indices[batch_idx]
        start, end = ranges[0][0], ranges[-1][1]
        out = self.slice(start, end)
        out.micro_batch_indices = [[(a - start, b - start) for a, b in ranges]]
        out.micro_batch_lengths = [list(self.micro_batch_lengths[batch_idx])]
        return out

    def make_microbatch_iterator(self, microbatch_size: int) -> Iterator[BatchedDataDict[T]]:
        """Consecutive slices of ``microbatch_size`` rows (the last may be shorter).

        With groups (``group_size`` > 1) the size must be a multiple of the group size, so that every
        micro-batch holds whole groups.
        """
        if microbatch_size < 1:
            raise ValueError(f"microbatch_size must be >= 1, got {microbatch_size}")
        self._check_group_multiple("microbatch_size", microbatch_size)
        for start in range(0, self.size, microbatch_size):
            yield self.slice(start, min(start + microbatch_size, self.size))

    def get_microbatch_iterator_len(self, microbatch_size: int) -> int:
        return -(-self.size // microbatch_size)

    def _check_group_multiple(self, what: str, rows: int) -> None:
        g = self.group_size
        if g > 1 and (rows % g or self.size % g):
            raise ValueError(
                f"{what}={rows} would split the groups of {g} rows that must stay together (a batch of "
                f"{self.size} rows); use a multiple of {g} (e.g. DPO: twice the number of pairs)"
            )

    def _planned(self, mode: str) -> Iterator[tuple[int, int, int]]:
        if self.micro_batch_indices is None or self.micro_batch_lengths is None:
            raise ValueError(
                f"{mode} needs micro-batch metadata: shard with shard_by_batch_size(..., "
                f"{'dynamic_batching_args' if mode == 'dynamic batching' else 'sequence_packing_args'}=...)"
            )
        g = self.group_size
        for ranges, lens in zip(self.micro_batch_indices, self.micro_batch_lengths):
            for (a, b), n in zip(ranges, lens):
                if a % g or b % g:
                    raise ValueError(
                        f"micro-batch rows {a}:{b} split a group of {g} rows; the plan was made without "
                        "group_size: set group_size before shard_by_batch_size"
                    )
                yield a, b, n

    def make_microbatch_iterator_with_dynamic_shapes(self) -> Iterator[BatchedDataDict[T]]:
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

    def make_microbatch_iterator_for_packable_sequences(self) -> Iterator[BatchedDataDict[T]]:
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

    def _fit_seq_dim(self, width: int | None, length: int) -> BatchedDataDict[T]:
        """Cut or zero-pad dim 1 of the sequence tensors from ``width`` to ``length``."""
        if width is None or length == width:
            return self
        for k, v in self.data.items():
            if _is_tensor(v) and v.dim() >= 2 and v.shape[1] == width:
                self.data[k] = _fit_dim1(v, length, 0)
        return self


def _fit_dim1(t: torch.Tensor, length: int, pad_value: Any) -> torch.Tensor:
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
