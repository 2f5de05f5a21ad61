"""Refit fingerprints: a cheap per-tensor checksum the sender and each engine compute and the core compares.

What is summed: a tensor's *first and last elements* and ``SAMPLES`` elements at a fixed stride
between them, as the raw bits of each element (an integer view of the same width, so NaN, -0.0 and
bf16 compare bit for bit), each multiplied by an odd position weight, summed in wrapping int64.
The cost is O(``SAMPLES``) per tensor, not O(bytes): the samples are strided views, copied once per
bucket on the tensors' device and once per refit to the CPU, and summed for every tensor at once.

Detection power (stated, and tested in ``tests/test_verified_refit.py``):

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

from functools import lru_cache
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

from rlcore.refit.buckets import RefitError

if TYPE_CHECKING:
    import torch

#: Elements sampled between the first and the last of each tensor.
SAMPLES = 64
_MASK = (1 << 64) - 1


def _bits(flat: "torch.Tensor") -> "torch.Tensor":
    """The raw bits of ``flat``'s elements as int64 (a reinterpretation, not a conversion)."""
    import torch

    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    return flat.view(width).to(torch.int64)


def sample_indices(numel: int, samples: int | None = SAMPLES) -> "torch.Tensor":
    """The flat positions summed for a tensor of ``numel`` elements: all of them when there are few
    (or ``samples`` is None), else the first, the last and ``samples`` at a fixed stride between."""
    import torch

    stop, step, tail = _slices(numel, samples)
    head = torch.arange(0, stop, step, dtype=torch.int64)
    return torch.cat([head, torch.tensor([numel - 1])]) if tail else head


def _slices(numel: int, samples: int | None) -> tuple[int, int, bool]:
    """``flat[:stop:step]`` (plus the last element when ``tail``) are the positions :func:`sample_indices`
    names: a view, so sampling a tensor costs no index tensor and no gather."""
    if samples is None or numel <= samples + 2:
        return numel, 1, False
    stride = (numel - 1) // (samples + 1)
    return samples * stride + 1, stride, True


@lru_cache(maxsize=1024)
def _plan(numel: int, samples: int | None) -> tuple[int, int, bool, "torch.Tensor"]:
    """The slices of a tensor of ``numel`` elements and their position weights (odd: a weight never zeroes a
    changed element in wrapping arithmetic); a model has few distinct sizes, so each is built once."""
    stop, step, tail = _slices(numel, samples)
    return stop, step, tail, sample_indices(numel, samples) * 2 + 1


class Fingerprints:
    """Fingerprints of tensors added bucket by bucket, read once at the end.

    :meth:`add` copies each tensor's sampled elements on the tensor's own device, one copy per dtype and
    device for all the tensors of a call (a bucket), so it may be called on views of a transport buffer that
    is reused afterwards; :meth:`result` moves the samples to the CPU in one copy per dtype and device and
    sums every tensor's at once, so a CUDA refit pays one wait for its fingerprints, not one per tensor.
    """

    def __init__(self, samples: int | None = SAMPLES) -> None:
        self.samples = samples
        self._names: list[str] = []
        self._sizes: list[tuple[int, int]] = []  # (numel, element size)
        self._groups: dict[tuple["torch.dtype", "torch.device"], list] = {}  # key -> [copies, members, weights]

    def add(self, named_tensors: Iterable[tuple[str, "torch.Tensor"]]) -> None:
        import torch

        plan = _plan if self.samples is not None else _plan.__wrapped__  # a full pass's positions are not kept
        views: dict[tuple["torch.dtype", "torch.device"], list["torch.Tensor"]] = {}
        with torch.no_grad():  # views of parameters without autograd's bookkeeping
            for name, tensor in named_tensors:
                self._add_views(name, tensor.reshape(-1), plan, views)
            for key, parts in views.items():  # the copy: the tensors may be views of a buffer reused next
                self._groups[key][0].append(torch.cat(parts))

    def _add_views(self, name: str, flat: "torch.Tensor", plan: Any, views: dict) -> None:
        """Record ``flat``'s sampled positions (as views, in ``views`` by dtype and device) and weights."""
        stop, step, tail, weights = plan(flat.numel(), self.samples)
        key = (flat.dtype, flat.device)
        copies_members_weights = self._groups.setdefault(key, [[], [], []])
        parts = views.setdefault(key, [])
        parts.append(flat[:stop:step])
        if tail:
            parts.append(flat[-1:])
        copies_members_weights[1].append(len(self._names))
        copies_members_weights[2].append(weights)
        self._names.append(name)
        self._sizes.append((flat.numel(), flat.element_size()))

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


def tensor_fingerprint(tensor: "torch.Tensor", samples: int | None = SAMPLES) -> int:
    """One tensor's checksum (an unsigned 64-bit int); equal tensors give equal checksums on any device."""
    return fingerprint([("", tensor)], samples)[""]


def fingerprint(named_tensors: Iterable[tuple[str, "torch.Tensor"]], samples: int | None = SAMPLES) -> dict[str, int]:
    """``{name: checksum}`` of every tensor; what the sender and each engine compute."""
    acc = Fingerprints(samples)
    acc.add(named_tensors)
    return acc.result()


class SentBytes(int):
    """The bytes a training rank sent in one refit (an ``int``, as the plugin API promises), carrying
    ``fingerprints``: ``{name: checksum}`` of the tensors it sent, which the core compares with each engine's."""

    fingerprints: dict[str, int]

    def __new__(cls, sent: int, fingerprints: Mapping[str, int]) -> "SentBytes":
        obj = super().__new__(cls, sent)
        obj.fingerprints = dict(fingerprints)
        return obj

    def __reduce__(self) -> tuple:
        return SentBytes, (int(self), self.fingerprints)


def check_fingerprints(sent: Mapping[str, int], held: Mapping[str, int], *, engine: str,
                       bucket_of: Mapping[str, int] | None = None) -> None:
    """Raise :class:`RefitError`, one line naming the first differing tensor, unless ``held`` equals ``sent``."""
    for name, value in sent.items():
        got = held.get(name)
        if got == value:
            continue
        where = f" (bucket {bucket_of[name]})" if bucket_of and name in bucket_of else ""
        state = "does not hold" if got is None else f"holds fingerprint {got:#018x} for"
        raise RefitError(f"refit verification failed: {engine} {state} tensor '{name}'{where}; "
                         f"the trainer sent {value:#018x}")
    extra = sorted(set(held) - set(sent))
    if extra:
        raise RefitError(f"refit verification failed: {engine} reports tensor '{extra[0]}', which was not sent")


def verify_engines(sent: Mapping[str, int] | Sequence[Mapping[str, int]], reports: Iterable[Mapping], *,
                   version: int, bucket_of: Mapping[str, int] | None = None) -> int:
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
            raise RefitError(f"refit verification failed: {engine} holds weight_version {held_version}, "
                             f"expected {version}")
        check_fingerprints(expected, report.get("fingerprints", {}), engine=engine, bucket_of=bucket_of)
    return version
