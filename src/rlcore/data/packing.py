"""Sequence packing: bin-packing sequences into fixed-capacity micro-batches.

Two layers:

- :func:`pack_sequences` is pure Python. It decides *which* samples share a
  micro-batch: bins of sample indices whose total length fits ``capacity``.
- :func:`pack_microbatch` / :func:`unpack_tokens` are the tensor side a backend
  uses: turn a right-padded ``[B, S]`` micro-batch into one ``[1, T]`` row
  (plus ``position_ids`` restarting per sequence and ``cu_seqlens`` for a
  varlen attention kernel), run the model, and scatter per-token results back
  to the contract's ``[B, S]`` layout.

torch is imported inside the tensor functions only.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

PackingAlgorithm = Literal[
    "concatenative", "first_fit_decreasing", "first_fit_shuffle", "modified_first_fit_decreasing"
]
ALGORITHMS: tuple[str, ...] = (
    "concatenative",
    "first_fit_decreasing",
    "first_fit_shuffle",
    "modified_first_fit_decreasing",
)


# --------------------------------------------------------------------------- #
# Bin packing
# --------------------------------------------------------------------------- #
class _FirstFit:
    """Bins with a max-segment tree over free space: "leftmost bin with room
    for ``size``" in O(log n), so FFD stays fast for thousands of sequences."""

    def __init__(self, capacity: int, max_bins: int) -> None:
        self.capacity = capacity
        self.n = 1
        while self.n < max(1, max_bins):
            self.n *= 2
        # Unopened bins are represented with free space -1 (never fit).
        self.tree = [-1] * (2 * self.n)
        self.bins: list[list[int]] = []
        self.free: list[int] = []

    def _set(self, pos: int, value: int) -> None:
        i = pos + self.n
        self.tree[i] = value
        i //= 2
        while i:
            self.tree[i] = max(self.tree[2 * i], self.tree[2 * i + 1])
            i //= 2

    def _leftmost_fit(self, size: int) -> int:
        if self.tree[1] < size:
            return -1
        i = 1
        while i < self.n:
            i = 2 * i if self.tree[2 * i] >= size else 2 * i + 1
        return i - self.n

    def open_bin(self) -> int:
        self.bins.append([])
        self.free.append(self.capacity)
        self._set(len(self.bins) - 1, self.capacity)
        return len(self.bins) - 1

    def put(self, b: int, idx: int, size: int) -> None:
        self.bins[b].append(idx)
        self.free[b] -= size
        self._set(b, self.free[b])

    def first_fit(self, idx: int, size: int) -> None:
        b = self._leftmost_fit(size)
        if b < 0:
            b = self.open_bin()
        self.put(b, idx, size)


def _concatenative(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    bins: list[list[int]] = []
    load = capacity + 1  # forces a first bin
    for i, n in enumerate(lengths):
        if load + n > capacity:
            bins.append([])
            load = 0
        bins[-1].append(i)
        load += n
    return bins


def _decreasing(lengths: Sequence[int], items: Sequence[int]) -> list[int]:
    # Stable: equal lengths keep index order, so results are deterministic.
    return sorted(items, key=lambda i: (-lengths[i], i))


def _first_fit(lengths: Sequence[int], capacity: int, order: Sequence[int]) -> list[list[int]]:
    ff = _FirstFit(capacity, len(lengths))
    for i in order:
        ff.first_fit(i, lengths[i])
    return ff.bins


def _shuffled(lengths: Sequence[int]) -> list[int]:
    """A random order seeded by the lengths themselves: every process that packs the same batch gets the
    same bins, different batches get different orders."""
    import random

    order = list(range(len(lengths)))
    random.Random(",".join(map(str, lengths))).shuffle(order)
    return order


class _Pool:
    """Remaining items of one size class, sorted ascending by (length, index)."""

    def __init__(self, lengths: Sequence[int], items: Sequence[int]) -> None:
        self.keys = sorted((lengths[i], i) for i in items)

    def __bool__(self) -> bool:
        return bool(self.keys)

    def smallest(self) -> int:
        return self.keys[0][0]

    def pop_smallest(self) -> tuple[int, int]:
        return self.keys.pop(0)

    def pop_largest_fitting(self, room: int) -> tuple[int, int] | None:
        # Largest length <= room; among equal lengths take the lowest index.
        pos = bisect.bisect_right(self.keys, (room, float("inf")))
        if pos == 0:
            return None
        length = self.keys[pos - 1][0]
        first = bisect.bisect_left(self.keys, (length, -1))
        return self.keys.pop(first)


def _modified_first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Johnson & Garey's Modified First Fit Decreasing (1985).

    FFD is at most 11/9·OPT (+ const); MFFD improves the bound to 71/60·OPT
    (+ const) by treating the items that pair up with a large item specially.
    With capacity ``C`` the items are classified as

    - large:  ``s > C/2``          (at most one per bin),
    - medium: ``C/3 < s <= C/2``,
    - small:  ``C/6 < s <= C/3``,
    - tiny:   ``s <= C/6``.

    Passes:

    1. Open one bin per large item, in decreasing order of size ("L-bins").
    2. Forward over the L-bins: if the smallest remaining medium item fits,
       put in the *largest* remaining medium item that fits; otherwise skip
       the bin.
    3. Backward over the L-bins that received no medium item: if the two
       smallest remaining small items fit together, put in the smallest small
       item and then the largest remaining small item that fits beside it.
       (Plain FFD would drop one big small item into each L-bin and waste the
       rest; pairing a smallest with a largest fills the bin much better.)
    4. Forward over all L-bins: while the smallest remaining item of any
       class fits, put in the largest remaining item that fits; then move on.
    5. Pack whatever is left with FFD into new bins (after pass 4 nothing left
       fits an L-bin).
    """
    C = capacity
    large = [i for i, s in enumerate(lengths) if 2 * s > C]
    medium = [i for i, s in enumerate(lengths) if 3 * s > C >= 2 * s]
    small = [i for i, s in enumerate(lengths) if 6 * s > C >= 3 * s]
    tiny = [i for i, s in enumerate(lengths) if C >= 6 * s]

    # Pass 1.
    bins = [[i] for i in _decreasing(lengths, large)]
    room = [C - lengths[b[0]] for b in bins]
    got_medium = [False] * len(bins)

    # Pass 2.
    mediums = _Pool(lengths, medium)
    for b in range(len(bins)):
        if not mediums or mediums.smallest() > room[b]:
            continue
        s, i = mediums.pop_largest_fitting(room[b])  # type: ignore[misc]
        bins[b].append(i)
        room[b] -= s
        got_medium[b] = True

    # Pass 3.
    smalls = _Pool(lengths, small)
    for b in reversed(range(len(bins))):
        if got_medium[b] or len(smalls.keys) < 2:
            continue
        if smalls.keys[0][0] + smalls.keys[1][0] > room[b]:
            continue
        s, i = smalls.pop_smallest()
        bins[b].append(i)
        room[b] -= s
        s, i = smalls.pop_largest_fitting(room[b])  # type: ignore[misc]  # fits: >= 2nd smallest
        bins[b].append(i)
        room[b] -= s

    # Pass 4.
    rest = _Pool(lengths, [i for _, i in mediums.keys + smalls.keys] + tiny)
    for b in range(len(bins)):
        while rest and rest.smallest() <= room[b]:
            s, i = rest.pop_largest_fitting(room[b])  # type: ignore[misc]
            bins[b].append(i)
            room[b] -= s

    # Pass 5.
    ff = _FirstFit(C, len(rest.keys))
    for i in _decreasing(lengths, [i for _, i in rest.keys]):
        ff.first_fit(i, lengths[i])
    return bins + ff.bins


def _split_bin(bin_: list[int], lengths: Sequence[int]) -> tuple[list[int], list[int]]:
    """Split one bin into two with balanced loads (largest item to the lighter; on a tie, to the one with
    fewer items, so that zero-length items cannot all land in one half and leave the other empty)."""
    a: list[int] = []
    b: list[int] = []
    la = lb = 0
    for i in _decreasing(lengths, bin_):
        if (la, len(a)) <= (lb, len(b)):
            a.append(i)
            la += lengths[i]
        else:
            b.append(i)
            lb += lengths[i]
    return sorted(a), sorted(b)


def _ensure_bin_count(
    bins: list[list[int]], lengths: Sequence[int], min_bin_count: int, multiple: int
) -> list[list[int]]:
    target = max(len(bins), min_bin_count)
    target = -(-target // multiple) * multiple
    if target > len(lengths):
        raise ValueError(
            f"cannot make {target} bins (at least {min_bin_count}, a multiple of "
            f"{multiple}) from {len(lengths)} sequences: every bin needs at least one "
            "sequence; use fewer data-parallel ranks or more sequences per step"
        )
    bins = [list(b) for b in bins]
    while len(bins) < target:
        # The fullest bin that can be split (>= 2 items); always exists because
        # there are more sequences than bins.
        j = max(
            (k for k in range(len(bins)) if len(bins[k]) >= 2),
            key=lambda k: sum(lengths[i] for i in bins[k]),
        )
        bins[j], new = _split_bin(bins[j], lengths)
        bins.append(new)
    return bins


def pack_sequences(
    lengths: Sequence[int],
    capacity: int,
    algorithm: PackingAlgorithm | str = "modified_first_fit_decreasing",
    min_bin_count: int = 1,
    bin_count_multiple: int = 1,
) -> list[list[int]]:
    """Pack sequences into bins of total length ``<= capacity``.

    Returns a list of bins, each a list of indices into ``lengths``; every
    index appears exactly once and no bin is empty. The number of bins is at
    least ``min_bin_count`` and a multiple of ``bin_count_multiple`` (pass the
    data-parallel size for both so every rank gets the same number of bins):
    when the algorithm produced too few, the fullest bins are split in two
    until it holds.

    Algorithms:

    - ``"concatenative"``: keep the input order, open a new bin when the next
      sequence does not fit.
    - ``"first_fit_decreasing"``: longest first, each into the first bin that
      fits (<= 11/9·OPT + 6/9 bins).
    - ``"first_fit_shuffle"``: the same in a random order (NeMo-RL's option;
      here the order is seeded by the lengths, so it is reproducible).
    - ``"modified_first_fit_decreasing"``: Johnson & Garey's MFFD
      (<= 71/60·OPT + 31/6 bins), see :func:`_modified_first_fit_decreasing`.

    Raises ``ValueError`` for a sequence longer than ``capacity`` (naming its
    index and length), an unknown algorithm, or fewer sequences than required
    bins.
    """
    if capacity <= 0:
        raise ValueError(f"capacity must be positive, got {capacity}")
    if min_bin_count < 1 or bin_count_multiple < 1:
        raise ValueError("min_bin_count and bin_count_multiple must be >= 1")
    lengths = [int(n) for n in lengths]
    for i, n in enumerate(lengths):
        if n < 0:
            raise ValueError(f"sequence {i} has negative length {n}")
        if n > capacity:
            raise ValueError(
                f"sequence {i} has length {n}, longer than the packing capacity "
                f"{capacity}; raise max_tokens_per_microbatch or truncate it"
            )
    if not lengths:
        if min_bin_count > 1:
            raise ValueError(f"no sequences to pack into {min_bin_count} bins")
        return []
    if algorithm == "concatenative":
        bins = _concatenative(lengths, capacity)
    elif algorithm == "first_fit_decreasing":
        bins = _first_fit(lengths, capacity, _decreasing(lengths, range(len(lengths))))
    elif algorithm == "first_fit_shuffle":
        bins = _first_fit(lengths, capacity, _shuffled(lengths))
    elif algorithm == "modified_first_fit_decreasing":
        bins = _modified_first_fit_decreasing(lengths, capacity)
    else:
        raise ValueError(f"unknown packing algorithm {algorithm!r}; choose one of {ALGORITHMS}")
    return _ensure_bin_count(bins, lengths, min_bin_count, bin_count_multiple)


# --------------------------------------------------------------------------- #
# Packed tensors for backends
# --------------------------------------------------------------------------- #
@dataclass
class PackedSequences:
    """One micro-batch packed into a single row.

    - ``input_ids`` ``[1, T]``: the valid tokens of every sequence back to back
      (each sequence followed by zero padding up to a multiple of
      ``pad_to_multiple``).
    - ``position_ids`` ``[1, T]``: 0, 1, 2, ... restarting at each sequence.
    - ``cu_seqlens`` ``[B + 1]`` int32: sequence boundaries in the packed row
      (padded lengths), what varlen attention kernels take.
    - ``input_lengths`` ``[B]``: valid (unpadded) length of each sequence.
    - ``max_seqlen``: the longest padded sequence (the kernels' ``max_seqlen``).
    - ``seq_len``: ``S`` of the ``[B, S]`` micro-batch it came from.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    input_lengths: torch.Tensor
    max_seqlen: int
    seq_len: int

    @property
    def batch_size(self) -> int:
        return int(self.input_lengths.shape[0])

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """Scatter a per-token result ``[1, T, ...]`` back to ``[B, S, ...]``."""
        return unpack_tokens(packed, self.cu_seqlens, self.batch_size, self.seq_len, self.input_lengths)


def pack_microbatch(input_ids: torch.Tensor, input_lengths: torch.Tensor, pad_to_multiple: int = 1) -> PackedSequences:
    """Pack a right-padded ``[B, S]`` micro-batch into one ``[1, T]`` row.

    ``pad_to_multiple`` pads every sequence (with token 0) to a multiple of it,
    for kernels or sequence/context parallelism that need aligned lengths;
    ``T`` is then a multiple too.
    """
    import torch

    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, S], got shape {tuple(input_ids.shape)}")
    B, S = input_ids.shape
    lengths = torch.as_tensor(input_lengths, device=input_ids.device).long().reshape(-1)
    if lengths.shape[0] != B:
        raise ValueError(f"input_lengths has {lengths.shape[0]} entries for a batch of {B}")
    if B and (int(lengths.max()) > S or int(lengths.min()) < 0):
        raise ValueError(f"input_lengths must lie in [0, {S}], got {lengths.tolist()}")
    m = max(1, int(pad_to_multiple))
    padded = (lengths + m - 1) // m * m
    cu = torch.zeros(B + 1, dtype=torch.long, device=input_ids.device)
    cu[1:] = torch.cumsum(padded, 0)
    T = int(cu[-1])

    cols = torch.arange(S, device=input_ids.device)
    valid = cols[None, :] < lengths[:, None]
    dest = (cu[:-1, None] + cols[None, :])[valid]
    packed_ids = torch.zeros(T, dtype=input_ids.dtype, device=input_ids.device)
    packed_ids[dest] = input_ids[valid]
    starts = torch.repeat_interleave(cu[:-1], padded)
    position_ids = torch.arange(T, device=input_ids.device) - starts
    return PackedSequences(
        input_ids=packed_ids.unsqueeze(0),
        position_ids=position_ids.unsqueeze(0),
        cu_seqlens=cu.to(torch.int32),
        input_lengths=lengths,
        max_seqlen=int(padded.max()) if B else 0,
        seq_len=int(S),
    )


def unpack_tokens(
    packed: torch.Tensor,
    cu_seqlens: torch.Tensor,
    batch_size: int,
    seq_len: int,
    input_lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Inverse of :func:`pack_microbatch` for any per-token tensor.

    ``packed`` is ``[1, T, ...]`` or ``[T, ...]``; returns ``[B, S, ...]``
    with sequence ``i`` in row ``i`` (first ``min(len_i, S)`` positions) and
    zeros elsewhere. ``len_i`` is ``input_lengths[i]`` when given, else the
    segment length from ``cu_seqlens`` (which includes per-sequence padding).
    """
    import torch

    cu = cu_seqlens.long().to(packed.device)
    T = int(cu[-1]) if cu.numel() else 0
    if packed.dim() >= 2 and packed.shape[0] == 1 and packed.shape[1] == T:
        packed = packed[0]  # [1, T, ...] -> [T, ...]
    if packed.shape[0] != T:
        raise ValueError(f"packed tensor has {packed.shape[0]} tokens, cu_seqlens says {T}")
    if cu.shape[0] != batch_size + 1:
        raise ValueError(f"cu_seqlens has {cu.shape[0]} entries for a batch of {batch_size}")
    seg = cu[1:] - cu[:-1]
    if input_lengths is not None:
        seg = torch.minimum(seg, torch.as_tensor(input_lengths, device=packed.device).long())
    out = packed.new_zeros((batch_size, seq_len) + tuple(packed.shape[1:]))
    cols = torch.arange(seq_len, device=packed.device)
    valid = cols[None, :] < seg[:, None]
    out[valid] = packed[(cu[:-1, None] + cols[None, :])[valid]]
    return out


def packed_next_token_logprobs(logits: torch.Tensor, packed: PackedSequences) -> torch.Tensor:
    """Token logprobs of a packed forward, in the contract's ``[B, S]`` layout.

    ``logits`` is ``[1, T, V]`` or ``[T, V]`` from a forward over
    ``packed.input_ids``. Position ``i`` of sequence ``b`` gets
    ``log p(token_i | tokens_<i)`` from the logits at packed position ``i-1``
    of the same sequence; position 0 and padding are 0 (design.md §2.2).
    Computed in float32. Backends with vocab-parallel logits compute their own
    and only use :meth:`PackedSequences.unpack`.
    """
    import torch

    if logits.dim() == 3:
        logits = logits[0]
    ids = packed.input_ids.reshape(-1)
    T = ids.shape[0]
    out = torch.zeros(T, dtype=torch.float32, device=logits.device)
    if T > 1:
        logp = torch.log_softmax(logits[:-1].float(), dim=-1)
        out[1:] = logp.gather(-1, ids[1:, None].to(logits.device)).squeeze(-1)
    # Sequence starts have no in-sequence context: 0 by contract.
    out = torch.where(packed.position_ids.reshape(-1).to(out.device) == 0, 0.0, out)
    return unpack_tokens(out, packed.cu_seqlens, packed.batch_size, packed.seq_len, packed.input_lengths)
