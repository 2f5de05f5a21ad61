"""Packing named tensors into flat byte buckets, and unpacking them (design.md §2.7).

Both sides of a refit derive the same bucket plan from the same metadata
(``{hf_name: (shape, dtype)}``, in the sender's deterministic order), so a
receiver knows every bucket's layout without being told.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

#: ``{hf_name: (shape, dtype name)}``, in send order. Plain Python values so it
#: pickles cheaply and can be compared without torch.
RefitMetadata = dict[str, tuple[tuple[int, ...], str]]

#: ``(dim, start, length)``: the slice of a tensor along one dimension that a receiver reads of it (an engine
#: rank of a tensor-parallel engine reads its shard of most tensors). A tensor without one is read whole.
Region = tuple[int, int, int]
#: ``{hf_name: Region}`` for the tensors a receiver reads only part of.
Regions = dict[str, Region]

#: What a receiver does with one bucket's ``(name, tensor)`` pairs. It may hold on to a tensor past
#: the call only until every tensor of its layer (:func:`layer_of`) has arrived: the transports keep
#: that much valid (views for layers whole in the bucket, copies for the others), no more.
LoadFn = Callable[[list[tuple[str, "torch.Tensor"]]], None]


class FingerprintSink(Protocol):
    """Where :func:`pack` hands the tensors it sent (:class:`rlcore.refit.fingerprint.Fingerprints`)."""

    def add(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None: ...


ALIGN = 256  # byte alignment of each tensor inside a bucket (what CUDA kernels like)


class RefitError(RuntimeError):
    """A refit could not complete; the message says which tensors and why."""


_ITEMSIZE = {
    "float64": 8,
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def to_dtype(name: str) -> torch.dtype:
    import torch

    return getattr(torch, name.removeprefix("torch."))


def nbytes(shape: tuple[int, ...], dtype: str) -> int:
    n = _ITEMSIZE[dtype.removeprefix("torch.")]
    for d in shape:
        n *= d
    return n


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def metadata_of(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> RefitMetadata:
    return {name: (tuple(t.shape), dtype_name(t.dtype)) for name, t in named_tensors}


@dataclass(frozen=True)
class Bucket:
    names: tuple[str, ...]
    offsets: tuple[int, ...]
    size: int  # bytes used, aligned


_LAYER = re.compile(r"^(.*?\.(?:layers|blocks)\.\d+)\.")


def layer_of(name: str) -> str:
    """The layer a tensor belongs to: a decoder layer (``model.layers.3``) or a vision tower's block
    (``model.visual.blocks.3``); the tensor's own name outside them.

    An engine may keep a layer's tensors until it has all of them (vLLM fuses q/k/v and
    gate/up per layer), so the plan keeps a layer in one bucket where it can.
    """
    match = _LAYER.match(name)
    return match.group(1) if match else name


def _runs(metadata: RefitMetadata) -> list[list[tuple[str, int]]]:
    """Consecutive tensors of the same layer, with their aligned sizes."""
    runs: list[list[tuple[str, int]]] = []
    for name, (shape, dtype) in metadata.items():
        entry = (name, _aligned(nbytes(shape, dtype)))
        if runs and layer_of(runs[-1][-1][0]) == layer_of(name):
            runs[-1].append(entry)
        else:
            runs.append([entry])
    return runs


def plan_buckets(metadata: RefitMetadata, bucket_bytes: int) -> list[Bucket]:
    """Consecutive tensors grouped into buckets of at most ``bucket_bytes``, cut between layers.

    A layer starts a new bucket when it does not fit in the current one; only a layer larger
    than ``bucket_bytes`` is split, tensor by tensor (and a tensor larger than that gets a
    bucket of its own). :func:`split_layer_names` says which tensors that left split.
    """
    buckets: list[Bucket] = []
    names: list[str] = []
    offsets: list[int] = []
    used = 0
    for run in _runs(metadata):
        run_bytes = sum(size for _, size in run)
        if names and used + run_bytes > bucket_bytes and run_bytes <= bucket_bytes:
            buckets.append(Bucket(tuple(names), tuple(offsets), used))
            names, offsets, used = [], [], 0
        for name, size in run:
            if names and used + size > bucket_bytes:
                buckets.append(Bucket(tuple(names), tuple(offsets), used))
                names, offsets, used = [], [], 0
            names.append(name)
            offsets.append(used)
            used += size
    if names:
        buckets.append(Bucket(tuple(names), tuple(offsets), used))
    return buckets


def split_layer_names(plan: list[Bucket]) -> frozenset[str]:
    """Names of tensors whose layer is spread over more than one bucket of ``plan``."""
    buckets_of: dict[str, set[int]] = {}
    for index, bucket in enumerate(plan):
        for name in bucket.names:
            buckets_of.setdefault(layer_of(name), set()).add(index)
    return frozenset(name for bucket in plan for name in bucket.names if len(buckets_of[layer_of(name)]) > 1)


def buffer_bytes(plan: list[Bucket]) -> int:
    return max((b.size for b in plan), default=ALIGN)


def pack(
    bucket: Bucket,
    tensors: Iterator[tuple[str, torch.Tensor]],
    buffer: torch.Tensor,
    metadata: RefitMetadata,
    fingerprints: FingerprintSink | None = None,
    regions: Regions | None = None,
) -> int:
    """Copy the bucket's tensors, pulled in order from ``tensors``, into the uint8 ``buffer``: one fused copy
    (``torch._foreach_copy_`` into the bucket's views) for the whole bucket, not one copy per tensor. Returns
    the bytes of those tensors it left out (see ``regions``; 0 without).

    The bucket's tensors are all alive until that copy, so a sender holds up to one bucket of gathered
    tensors at a time. ``regions``: of those tensors only the slice the receiver reads is copied, to where it
    sits in the tensor's place in the bucket (the rest of that place keeps whatever it held).
    ``fingerprints`` (:class:`rlcore.refit.fingerprint.Fingerprints`): where the sampled elements of what was
    sent (a tensor, or its region) are gathered, for verified refit, from the buffer after the copy.
    """
    import torch

    targets, sources, named = [], [], []
    region_targets, region_sources = [], []
    skipped = 0
    for name, offset in zip(bucket.names, bucket.offsets):
        got_name, t = next(tensors)
        shape, dtype = metadata[name]
        if got_name != name or tuple(t.shape) != tuple(shape) or dtype_name(t.dtype) != _norm(dtype):
            raise RefitError(
                f"sender produced {got_name} {tuple(t.shape)} {dtype_name(t.dtype)} where the "
                f"metadata expects {name} {tuple(shape)} {dtype}: iteration order must match "
                "prepare_refit_info()"
            )
        region = regions.get(name) if regions else None
        if region is not None:
            place = buffer[offset : offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            region_targets.append(region_view(place, region))
            region_sources.append(region_view(t.detach(), region))
            named.append((name, region_targets[-1]))
            skipped += (t.numel() - region_targets[-1].numel()) * t.element_size()
            continue
        flat = t.detach().contiguous().reshape(-1)
        targets.append(buffer[offset : offset + flat.numel() * flat.element_size()])
        sources.append(flat.view(torch.uint8))
        named.append((name, targets[-1].view(flat.dtype)))  # fingerprinted: the bytes sent, one gather
    if targets:
        torch._foreach_copy_(targets, sources, non_blocking=True)
    if region_targets:
        torch._foreach_copy_(region_targets, region_sources, non_blocking=True)
    if fingerprints is not None:
        fingerprints.add(named)
    return skipped


def skipped_bytes(regions: Regions, metadata: RefitMetadata) -> int:
    """The bytes of ``metadata``'s tensors outside ``regions``: what a refit that sends only the regions skips."""
    skipped = 0
    for name, (dim, _, length) in regions.items():
        shape, dtype = metadata[name]
        skipped += nbytes(shape, dtype) // shape[dim] * (shape[dim] - length)
    return skipped


def region_view(tensor: torch.Tensor, region: Region | None) -> torch.Tensor:
    """The part of ``tensor`` a receiver reads: ``region`` (a view), or the whole tensor when None."""
    if region is None:
        return tensor
    dim, start, length = region
    return tensor.narrow(dim, start, length)


def check_regions(regions: Regions, metadata: RefitMetadata) -> None:
    """Raise :class:`RefitError` unless every region names a tensor of ``metadata`` and fits inside it."""
    for name, region in regions.items():
        if name not in metadata:
            raise RefitError(f"the receiver asked for a region of '{name}', which is not sent")
        shape = metadata[name][0]
        dim, start, length = region
        if not (0 <= dim < len(shape) and 0 <= start and 0 < length and start + length <= shape[dim]):
            raise RefitError(f"the receiver's region {tuple(region)} of '{name}' does not fit its shape {shape}")


def wait_for_stream(device: torch.device) -> None:
    """On CUDA, wait until the work queued so far on ``device``'s current stream is done (an event recorded
    there, not a device-wide synchronise: other streams run on); nothing to wait for on CPU."""
    if device.type != "cuda":
        return
    import torch

    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(device))
    done.synchronize()


def unpack(
    bucket: Bucket, buffer: torch.Tensor, metadata: RefitMetadata, copy: frozenset[str] = frozenset()
) -> list[tuple[str, torch.Tensor]]:
    """The bucket's tensors: views inside ``buffer`` (valid until the buffer is reused), copies for ``copy``.

    Transports pass ``copy=split_layer_names(plan)``: a receiver may then hold on to a tensor
    until its layer is complete — the views' layers all complete within the bucket.
    """
    die_at(f"bucket:{_next_bucket()}")  # test hook (RLCORE_TEST_KILL_ENGINE_AT), nothing when unset
    out = []
    for name, offset in zip(bucket.names, bucket.offsets):
        shape, dtype = metadata[name]
        n = nbytes(shape, dtype)
        view = buffer[offset : offset + n].view(to_dtype(dtype)).view(shape)
        out.append((name, view.clone() if name in copy else view))
    return out


def _norm(dtype: str) -> str:
    return dtype.removeprefix("torch.")  # accept "torch.float32" as well as "float32"


def check_metadata(expected: RefitMetadata, offered: RefitMetadata) -> None:
    """Raise :class:`RefitError` unless ``offered`` has exactly the expected names, shapes and dtypes."""
    missing = [n for n in expected if n not in offered]
    extra = [n for n in offered if n not in expected]
    wrong = [
        f"{n}: expected {tuple(expected[n][0])} {expected[n][1]}, got {tuple(offered[n][0])} {offered[n][1]}"
        for n in expected
        if n in offered
        and (tuple(expected[n][0]) != tuple(offered[n][0]) or _norm(expected[n][1]) != _norm(offered[n][1]))
    ]
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} tensor(s): {', '.join(missing[:5])}")
    if extra:
        problems.append(f"unexpected {len(extra)} tensor(s): {', '.join(extra[:5])}")
    if wrong:
        problems.append("mismatched " + "; ".join(wrong[:5]))
    if problems:
        raise RefitError("refit rejected before any weight was changed: " + "; ".join(problems))


# -- test hook: an engine that dies inside a refit's weight stream ------------------------------------------

#: ``<phase>[:STOP]``, the phase ``start`` (the engine's collective receive began, nothing received),
#: ``bucket:<k>`` (the k-th bucket this engine process unpacks has arrived and is not loaded yet: its first
#: refit's bucket k, the next bucket already on the wire) or ``end`` (every bucket of a collective refit loaded,
#: before the engine returns). ``:STOP``: the engine freezes there (SIGSTOP, a hung peer) instead of dying.
KILL_ENGINE_AT_ENV = "RLCORE_TEST_KILL_ENGINE_AT"
#: A file: the kill happens once (the first engine process to reach the phase creates it and writes
#: ``<time> <pid>``); restarted engines then live. Unset: every engine that reaches the phase dies.
KILL_ENGINE_STAMP_ENV = "RLCORE_TEST_KILL_ENGINE_STAMP"
_unpacked = [0]


def _next_bucket() -> int:
    _unpacked[0] += 1
    return _unpacked[0] - 1


def die_at(phase: str) -> None:
    """Test hook: SIGKILL (or SIGSTOP) this engine process when ``RLCORE_TEST_KILL_ENGINE_AT`` names ``phase``,
    so tests kill an engine at a chosen moment of the weight stream instead of at wall-clock offsets. Unset:
    nothing."""
    wanted = os.environ.get(KILL_ENGINE_AT_ENV, "")
    freeze = wanted.endswith(":STOP")
    if wanted.removesuffix(":STOP") != phase:
        return
    if stamp := os.environ.get(KILL_ENGINE_STAMP_ENV):
        try:
            fd = os.open(stamp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            return  # one kill per stamp: this engine was started after it
        os.write(fd, f"{time.time()!r} {os.getpid()}".encode())
        os.close(fd)
    os.kill(os.getpid(), signal.SIGSTOP if freeze else signal.SIGKILL)
