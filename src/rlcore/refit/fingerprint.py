"""Refit fingerprints: a cheap per-tensor checksum the sender and each engine compute and the core compares.

What is summed: a tensor's *first and last elements* and ``SAMPLES`` elements at a fixed stride
between them, as the raw bits of each element (an integer view of the same width, so NaN, -0.0 and
bf16 compare bit for bit), each multiplied by an odd position weight, summed in wrapping int64.
The cost is O(``SAMPLES``) per tensor, not O(bytes): a bucket's tensors, views of one transport buffer
(the sender fingerprints its buffer after packing, the engine the buffer it received), are sampled with one
gather per dtype on that buffer (a tensor's region, the slice one tensor-parallel engine rank reads, is a
strided view of it and is sampled in that gather too, in row-major order: the fingerprint of
``region.contiguous()``); other tensors as strided views, copied once per bucket. The samples move to the CPU
once per refit and are summed for every tensor at once.

Detection power (stated, and tested in ``tests/refit/test_verified_refit.py``):

- a tensor with at most ``SAMPLES + 2`` elements is summed whole: any changed element is caught;
- in a larger tensor, any change to a sampled element (the first, the last, every stride-th) is
  caught, as is any change that touches many elements: a tensor that is zeroed, scaled, cast to
  another dtype, shifted by an element, truncated, swapped with another tensor of the same shape
  (the sum is keyed by name and the position weights differ per element), or left unloaded;
- a single flipped element between two samples is *not* caught. That is the price of the cost
  bound; :func:`fingerprint` with ``samples=None`` sums every element, for CPU refits where a full
  pass is cheap enough.

A wrong answer is one line naming the engine, the bucket and the tensor (:func:`check_fingerprints`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache
from typing import TYPE_CHECKING

from rlcore.refit.buckets import RefitError

if TYPE_CHECKING:
    import torch

#: One tensor of an :meth:`Fingerprints.add` call: its member index, the tensor, its slices
#: ``(stop, step, tail)`` and its position weights.
_Entry = tuple[int, "torch.Tensor", tuple[int, int, bool], "torch.Tensor"]
#: Per dtype and device: the sampled copies, the members they hold, and the members' position weights.
_Group = tuple[list["torch.Tensor"], list[int], list["torch.Tensor"]]
#: Where a tensor's elements live: its storage (None: sampled alone), dtype and device.
_StorageKey = tuple[int | None, "torch.dtype", "torch.device"]


#: Elements sampled between the first and the last of each tensor.
SAMPLES = 64
_MASK = (1 << 64) - 1


def _bits(flat: torch.Tensor) -> torch.Tensor:
    """The raw bits of ``flat``'s elements as int64 (a reinterpretation, not a conversion)."""
    import torch

    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    return flat.view(width).to(torch.int64)


def sample_indices(numel: int, samples: int | None = SAMPLES) -> torch.Tensor:
    """The flat positions summed for a tensor of ``numel`` elements: all of them when there are few
    (or ``samples`` is None), else the first, the last and ``samples`` at a fixed stride between."""
    import torch

    stop, step, tail = _slices(numel, samples)
    head = torch.arange(0, stop, step, dtype=torch.int64)
    return torch.cat([head, torch.tensor([numel - 1])]) if tail else head


def _slices(numel: int, samples: int | None) -> tuple[int, int, bool]:
    """``flat[:stop:step]`` (plus the last element when ``tail``) are the positions :func:`sample_indices`
    names: a view, for a tensor sampled alone (one of a bucket's views is gathered instead)."""
    if samples is None or numel <= samples + 2:
        return numel, 1, False
    stride = (numel - 1) // (samples + 1)
    return samples * stride + 1, stride, True


@lru_cache(maxsize=1024)
def _plan(numel: int, samples: int | None) -> tuple[int, int, bool, torch.Tensor]:
    """The slices of a tensor of ``numel`` elements and their position weights (odd: a weight never zeroes a
    changed element in wrapping arithmetic); a model has few distinct sizes, so each is built once."""
    stop, step, tail = _slices(numel, samples)
    return stop, step, tail, sample_indices(numel, samples) * 2 + 1


def _gather(entries: list[_Entry]) -> torch.Tensor:
    """The sampled elements of ``entries`` (tensors of one storage, dtype and device, contiguous or strided
    views such as a tensor's region), in order: one gather on the storage, at positions built once per layout
    (a bucket's offsets repeat every refit)."""
    first = entries[0][1]
    layout = tuple(
        (tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()), *slices)
        for _, tensor, slices, _ in entries
    )
    whole = first.untyped_storage().nbytes() // first.element_size()
    return first.as_strided((whole,), (1,), 0).index_select(0, _storage_positions(layout, first.device))


@lru_cache(maxsize=256)
def _storage_positions(
    layout: tuple[tuple[int, tuple[int, ...], tuple[int, ...], int, int, bool], ...], device: torch.device
) -> torch.Tensor:
    """The storage positions of :func:`sample_indices` (row-major element order) for tensors at
    ``(storage offset, shape, strides, stop, step, tail)``."""
    import torch

    parts = []
    for offset, shape, strides, stop, step, tail in layout:
        flat = torch.arange(0, stop, step, dtype=torch.int64)
        if tail:
            flat = torch.cat([flat, torch.tensor([_numel(shape) - 1], dtype=torch.int64)])
        position = torch.full_like(flat, offset)
        for size, stride in zip(reversed(shape), reversed(strides)):  # unravel the flat index, innermost first
            position += (flat % size) * stride
            flat = flat // size
        parts.append(position)
    return torch.cat(parts).to(device)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class Fingerprints:
    """Fingerprints of tensors added bucket by bucket, read once at the end.

    :meth:`add` copies each tensor's sampled elements on the tensor's own device, so it may be called on
    views of a transport buffer that is reused afterwards. Tensors of one call that are views of one storage
    (a bucket's tensors unpacked from the receive buffer, or regions of them) and any non-contiguous view are
    sampled with one gather on that storage; the others (a sender's separate parameters) as strided views,
    copied once per dtype and device.
    The cost is per torch call, not per byte read, hence one gather per bucket, not views per tensor.
    :meth:`result` moves the samples to the CPU in one copy per dtype and device and sums every tensor's
    at once, so a CUDA refit pays one wait for its fingerprints, not one per tensor.
    """

    def __init__(self, samples: int | None = SAMPLES) -> None:
        self.samples = samples
        self._names: list[str] = []
        self._sizes: list[tuple[int, int]] = []  # (numel, element size)
        self._groups: dict[tuple[torch.dtype, torch.device], _Group] = {}

    def add(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        import torch

        plan = _plan if self.samples is not None else _plan.__wrapped__  # a full pass's positions are not kept
        by_storage: dict[_StorageKey, list[_Entry]] = {}
        with torch.no_grad():  # views of parameters without autograd's bookkeeping
            for name, tensor in named_tensors:
                numel = tensor.numel()
                stop, step, tail, positions = plan(numel, self.samples)
                storage = tensor.untyped_storage().data_ptr() if numel else None
                by_storage.setdefault((storage, tensor.dtype, tensor.device), []).append(
                    (len(self._names), tensor, (stop, step, tail), positions)
                )
                self._names.append(name)
                self._sizes.append((numel, tensor.element_size()))
            views: dict[tuple[torch.dtype, torch.device], _Group] = {}  # the same, views not yet copied
            for (storage, dtype, device), entries in by_storage.items():
                copies_members_weights = self._groups.setdefault((dtype, device), ([], [], []))
                gather = len(entries) > 1 or not entries[0][1].is_contiguous()  # a strided view: no flat copy
                if storage is not None and gather and self.samples is not None:
                    copies_members_weights[0].append(_gather(entries))  # the copy, in one call
                    target = copies_members_weights
                else:
                    target = views.setdefault((dtype, device), ([], [], []))
                    for _, tensor, (stop, step, tail), _ in entries:
                        flat = tensor.reshape(-1)
                        target[0].append(flat[:stop:step])
                        if tail:
                            target[0].append(flat[-1:])
                for member, _, _, member_weights in entries:
                    target[1].append(member)
                    target[2].append(member_weights)
            for key, (parts, members, weights) in views.items():  # the copy: views of a buffer reused next
                copies_members_weights = self._groups[key]
                copies_members_weights[0].append(torch.cat(parts))
                copies_members_weights[1].extend(members)
                copies_members_weights[2].extend(weights)

    def result(self) -> dict[str, int]:
        """``{name: checksum}`` of every tensor added (a name added twice: its last tensor)."""
        import torch

        totals = [0] * len(self._names)
        for copies, members, weights in self._groups.values():
            picked = _bits(torch.cat(copies).cpu())
            counts = [w.numel() for w in weights]
            owner = torch.repeat_interleave(torch.arange(len(members)), torch.tensor(counts, dtype=torch.int64))
            sums = torch.zeros(len(members), dtype=torch.int64).index_add_(0, owner, picked * torch.cat(weights))
            for member, total in zip(members, sums.tolist()):  # wrapping int64 sums: the order does not matter
                totals[member] = total
        out = {}
        for name, total, (numel, size) in zip(self._names, totals, self._sizes):
            # the element count and dtype width enter too, so a truncated or re-typed tensor differs
            out[name] = (total * 1_000_003 + numel * 31 + size) & _MASK
        return out


def tensor_fingerprint(tensor: torch.Tensor, samples: int | None = SAMPLES) -> int:
    """One tensor's checksum (an unsigned 64-bit int); equal tensors give equal checksums on any device."""
    return fingerprint([("", tensor)], samples)[""]


def fingerprint(named_tensors: Iterable[tuple[str, torch.Tensor]], samples: int | None = SAMPLES) -> dict[str, int]:
    """``{name: checksum}`` of every tensor; what the sender and each engine compute."""
    acc = Fingerprints(samples)
    acc.add(named_tensors)
    return acc.result()


class SentBytes(int):
    """The bytes a training rank sent in one refit (an ``int``, as the plugin API promises), carrying
    ``fingerprints``: ``{name: checksum}`` of the tensors it sent, which the core compares with each engine's."""

    fingerprints: dict[str, int]

    def __new__(cls, sent: int, fingerprints: Mapping[str, int]) -> SentBytes:
        obj = super().__new__(cls, sent)
        obj.fingerprints = dict(fingerprints)
        return obj

    def __reduce__(self) -> tuple[type[SentBytes], tuple[int, dict[str, int]]]:
        return SentBytes, (int(self), self.fingerprints)


def check_fingerprints(
    sent: Mapping[str, int], held: Mapping[str, int], *, engine: str, bucket_of: Mapping[str, int] | None = None
) -> None:
    """Raise :class:`RefitError`, one line naming the first differing tensor, unless ``held`` equals ``sent``."""
    for name, value in sent.items():
        got = held.get(name)
        if got == value:
            continue
        where = f" (bucket {bucket_of[name]})" if bucket_of and name in bucket_of else ""
        state = "does not hold" if got is None else f"holds fingerprint {got:#018x} for"
        raise RefitError(
            f"refit verification failed: {engine} {state} tensor '{name}'{where}; the trainer sent {value:#018x}"
        )
    extra = sorted(set(held) - set(sent))
    if extra:
        raise RefitError(f"refit verification failed: {engine} reports tensor '{extra[0]}', which was not sent")


def verify_engines(
    sent: Mapping[str, int] | Sequence[Mapping[str, int]],
    reports: Iterable[Mapping[str, object]],
    *,
    version: int,
    bucket_of: Mapping[str, int] | None = None,
) -> int:
    """Check each engine's report ``{"weight_version": int, "fingerprints": {name: int}}`` after a refit.

    ``sent``: the fingerprints every engine was sent, or one mapping per engine (engines fed by different
    training ranks). Returns the version every engine holds; :class:`RefitError` in one line naming the
    engine (and the tensor) when an engine holds another version or other bytes than were sent."""
    reports = list(reports)
    per_engine = [sent] * len(reports) if isinstance(sent, Mapping) else list(sent)
    if len(per_engine) != len(reports):
        raise RefitError(f"refit verification failed: {len(reports)} engines reported, {len(per_engine)} were fed")
    for rank, (expected, report) in enumerate(zip(per_engine, reports)):
        engine = f"engine {rank}"
        held_version = report.get("weight_version")
        if held_version != version:
            raise RefitError(
                f"refit verification failed: {engine} holds weight_version {held_version}, expected {version}"
            )
        held = report.get("fingerprints", {})
        if not isinstance(held, Mapping):
            raise RefitError(f"refit verification failed: {engine} reports fingerprints {held!r}, not a mapping")
        check_fingerprints(expected, held, engine=engine, bucket_of=bucket_of)
    return version
