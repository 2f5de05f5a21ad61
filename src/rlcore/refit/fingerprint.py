"""Refit fingerprints: a cheap per-tensor checksum the sender and each engine compute and the core compares.

What is summed: a tensor's *first and last elements* and ``SAMPLES`` elements at a fixed stride
between them, as the raw bits of each element (an integer view of the same width, so NaN, -0.0 and
bf16 compare bit for bit), each multiplied by an odd position weight, summed in wrapping int64.
The cost is O(``SAMPLES``) per tensor, not O(bytes): one small gather on the tensor's own device
and one copy of ~66 elements to the CPU.

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
from typing import TYPE_CHECKING, Iterable, Mapping, Sequence

from rlcore.refit.buckets import RefitError

if TYPE_CHECKING:
    import torch

#: Elements sampled between the first and the last of each tensor.
SAMPLES = 64
_MASK = (1 << 64) - 1


def _bits(flat: "torch.Tensor") -> "torch.Tensor":
    """The raw bits of ``flat``'s elements as int64 (a reinterpretation, not a conversion)."""
    import torch

    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    return flat.view(width).to(torch.int64)


def sample_indices(numel: int, samples: int | None = SAMPLES) -> "torch.Tensor":
    """The flat positions summed for a tensor of ``numel`` elements: all of them when there are few
    (or ``samples`` is None), else the first, the last and ``samples`` at a fixed stride between."""
    import torch

    if samples is None or numel <= samples + 2:
        return torch.arange(numel, dtype=torch.int64)
    stride = (numel - 1) // (samples + 1)
    inner = torch.arange(1, samples + 1, dtype=torch.int64) * stride
    return torch.cat([torch.zeros(1, dtype=torch.int64), inner, torch.tensor([numel - 1])])


@lru_cache(maxsize=1024)
def _plan(numel: int, samples: int | None, device: str) -> tuple["torch.Tensor", "torch.Tensor"]:
    """The sampled positions on ``device`` and their weights (odd: a weight never zeroes a changed element in
    wrapping arithmetic); a model has few distinct sizes, so each is built once."""
    index = sample_indices(numel, samples)
    return index.to(device), index * 2 + 1


class Fingerprints:
    """Fingerprints of tensors added bucket by bucket, read once at the end.

    :meth:`add` gathers each tensor's sampled elements on the tensor's own device (no wait), so it may be
    called on views of a transport buffer that is reused afterwards; :meth:`result` moves every gathered
    sample to the CPU in one copy, so a CUDA refit pays one wait for its fingerprints, not one per tensor.
    """

    def __init__(self, samples: int | None = SAMPLES) -> None:
        self.samples = samples
        self._names: list[str] = []
        self._picked: list["torch.Tensor"] = []
        self._weights: list["torch.Tensor"] = []  # the position weights of each tensor's samples (CPU)
        self._sizes: list[tuple[int, int]] = []  # (numel, element size)

    def add(self, named_tensors: Iterable[tuple[str, "torch.Tensor"]]) -> None:
        plan = _plan if self.samples is not None else _plan.__wrapped__  # a full pass's positions are not kept
        for name, tensor in named_tensors:
            flat = tensor.detach().reshape(-1)
            index, weights = plan(flat.numel(), self.samples, str(flat.device))
            self._names.append(name)
            self._weights.append(weights)
            self._picked.append(_bits(flat.index_select(0, index)))
            self._sizes.append((flat.numel(), flat.element_size()))

    def result(self) -> dict[str, int]:
        """``{name: checksum}`` of every tensor added (a name added twice: its last tensor)."""
        import torch

        if not self._names:
            return {}
        by_device: dict[str, list[int]] = {}
        for i, picked in enumerate(self._picked):
            by_device.setdefault(str(picked.device), []).append(i)
        on_cpu: list["torch.Tensor"] = [None] * len(self._picked)  # type: ignore[list-item]
        for members in by_device.values():  # one transfer per device
            moved = torch.cat([self._picked[i] for i in members]).cpu()
            for i, part in zip(members, moved.split([self._picked[i].numel() for i in members])):
                on_cpu[i] = part
        out = {}
        for name, picked, weights, (numel, size) in zip(self._names, on_cpu, self._weights, self._sizes):
            total = int((picked * weights).sum(dtype=torch.int64)) if picked.numel() else 0
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
