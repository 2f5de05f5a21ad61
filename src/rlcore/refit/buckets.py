"""Packing named tensors into flat byte buckets, and unpacking them (design.md §2.7).

Both sides of a refit derive the same bucket plan from the same metadata
(``{hf_name: (shape, dtype)}``, in the sender's deterministic order), so a
receiver knows every bucket's layout without being told.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Iterator

if TYPE_CHECKING:
    import torch

#: ``{hf_name: (shape, dtype name)}``, in send order. Plain Python values so it
#: pickles cheaply and can be compared without torch.
RefitMetadata = dict[str, tuple[tuple[int, ...], str]]

ALIGN = 256  # byte alignment of each tensor inside a bucket (what CUDA kernels like)


class RefitError(RuntimeError):
    """A refit could not complete; the message says which tensors and why."""


_ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4,
             "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}


def dtype_name(dtype: "torch.dtype") -> str:
    return str(dtype).removeprefix("torch.")


def to_dtype(name: str) -> "torch.dtype":
    import torch

    return getattr(torch, name.removeprefix("torch."))


def nbytes(shape: tuple[int, ...], dtype: str) -> int:
    n = _ITEMSIZE[dtype.removeprefix("torch.")]
    for d in shape:
        n *= d
    return n


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def metadata_of(named_tensors: Iterable[tuple[str, "torch.Tensor"]]) -> RefitMetadata:
    return {name: (tuple(t.shape), dtype_name(t.dtype)) for name, t in named_tensors}


@dataclass(frozen=True)
class Bucket:
    names: tuple[str, ...]
    offsets: tuple[int, ...]
    size: int  # bytes used, aligned


def plan_buckets(metadata: RefitMetadata, bucket_bytes: int) -> list[Bucket]:
    """Consecutive tensors grouped into buckets of at most ``bucket_bytes`` (a larger tensor gets its own)."""
    buckets: list[Bucket] = []
    names: list[str] = []
    offsets: list[int] = []
    used = 0
    for name, (shape, dtype) in metadata.items():
        size = _aligned(nbytes(shape, dtype))
        if names and used + size > bucket_bytes:
            buckets.append(Bucket(tuple(names), tuple(offsets), used))
            names, offsets, used = [], [], 0
        names.append(name)
        offsets.append(used)
        used += size
    if names:
        buckets.append(Bucket(tuple(names), tuple(offsets), used))
    return buckets


def buffer_bytes(plan: list[Bucket]) -> int:
    return max((b.size for b in plan), default=ALIGN)


def pack(bucket: Bucket, tensors: Iterator[tuple[str, "torch.Tensor"]], buffer: "torch.Tensor",
         metadata: RefitMetadata) -> None:
    """Copy the bucket's tensors, pulled in order from ``tensors``, into the uint8 ``buffer``."""
    import torch

    for name, offset in zip(bucket.names, bucket.offsets):
        got_name, t = next(tensors)
        shape, dtype = metadata[name]
        if got_name != name or tuple(t.shape) != tuple(shape) or dtype_name(t.dtype) != _norm(dtype):
            raise RefitError(f"sender produced {got_name} {tuple(t.shape)} {dtype_name(t.dtype)} where the "
                             f"metadata expects {name} {tuple(shape)} {dtype}: iteration order must match "
                             "prepare_refit_info()")
        n = t.numel() * t.element_size()
        src = t.detach().contiguous().reshape(-1).view(torch.uint8)
        buffer[offset:offset + n].copy_(src, non_blocking=True)


def unpack(bucket: Bucket, buffer: "torch.Tensor", metadata: RefitMetadata) -> list[tuple[str, "torch.Tensor"]]:
    """Views of the bucket's tensors inside ``buffer`` (valid until the buffer is reused)."""
    out = []
    for name, offset in zip(bucket.names, bucket.offsets):
        shape, dtype = metadata[name]
        n = nbytes(shape, dtype)
        out.append((name, buffer[offset:offset + n].view(to_dtype(dtype)).view(shape)))
    return out


def _norm(dtype: str) -> str:
    return dtype.removeprefix("torch.")  # accept "torch.float32" as well as "float32"


def check_metadata(expected: RefitMetadata, offered: RefitMetadata) -> None:
    """Raise :class:`RefitError` unless ``offered`` has exactly the expected names, shapes and dtypes."""
    missing = [n for n in expected if n not in offered]
    extra = [n for n in offered if n not in expected]
    wrong = [f"{n}: expected {tuple(expected[n][0])} {expected[n][1]}, got {tuple(offered[n][0])} {offered[n][1]}"
             for n in expected if n in offered and
             (tuple(expected[n][0]) != tuple(offered[n][0]) or _norm(expected[n][1]) != _norm(offered[n][1]))]
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} tensor(s): {', '.join(missing[:5])}")
    if extra:
        problems.append(f"unexpected {len(extra)} tensor(s): {', '.join(extra[:5])}")
    if wrong:
        problems.append("mismatched " + "; ".join(wrong[:5]))
    if problems:
        raise RefitError("refit rejected before any weight was changed: " + "; ".join(problems))
