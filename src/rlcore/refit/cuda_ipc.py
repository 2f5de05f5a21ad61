"""CUDA IPC handles of refit buffers as plain data (JSON), never as a pickle.

The receiver of a colocated refit gets the sender's buffer handle over a
socket. ``torch.multiprocessing`` describes a CUDA tensor as a call,
``rebuild_cuda_tensor(*args)``, meant to be pickled; unpickling bytes from a
socket would run whatever call they name. Here only the arguments travel, as
JSON; the receiver calls ``rebuild_cuda_tensor`` itself, with the two classes
among them picked by name from fixed allow-lists and every other field
type-checked.

The fields are the arguments of ``torch.multiprocessing.reductions.rebuild_cuda_tensor``
in torch 2.13, in order (see :data:`FIELDS`).
"""

from __future__ import annotations

import base64
import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    #: A field decoded for ``rebuild_cuda_tensor``.
    RebuildArg = type | torch.dtype | bytes | tuple[int, ...] | int | bool | None

#: A field of a handle as JSON: a class or dtype by name, base64 bytes, integers, a flag.
JsonField = str | int | bool | list[int] | None

#: ``rebuild_cuda_tensor``'s parameters, in order, with the JSON form of each.
FIELDS: tuple[tuple[str, str], ...] = (
    ("tensor_cls", "class"),  # torch.Tensor or torch.nn.Parameter, by name
    ("tensor_size", "ints"),
    ("tensor_stride", "ints"),
    ("tensor_offset", "int"),
    ("storage_cls", "class"),  # torch.storage.TypedStorage, by name
    ("dtype", "dtype"),  # e.g. "uint8"
    ("storage_device", "int"),  # CUDA device index
    ("storage_handle", "bytes"),  # cudaIpcMemHandle (base64); None for an empty storage
    ("storage_size_bytes", "int"),
    ("storage_offset_bytes", "int"),
    ("requires_grad", "bool"),
    ("ref_counter_handle", "bytes"),  # the sender's shared-memory reference counter
    ("ref_counter_offset", "int"),
    ("event_handle", "bytes"),  # cudaIpcEventHandle
    ("event_sync_required", "bool"),
)
_VERSION = 1


def _classes() -> dict[str, type]:
    import torch

    return {
        "torch.Tensor": torch.Tensor,
        "torch.nn.parameter.Parameter": torch.nn.Parameter,
        "torch.storage.TypedStorage": torch.storage.TypedStorage,
    }


def _dtypes() -> dict[str, torch.dtype]:
    import torch

    return {str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)}


def _class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _encode(kind: str, value: object) -> JsonField:
    if kind == "class":
        assert isinstance(value, type)
        return _class_name(value)
    if kind == "dtype":
        return str(value).removeprefix("torch.")
    if kind == "bytes":
        assert value is None or isinstance(value, bytes)
        return None if value is None else base64.b64encode(value).decode("ascii")
    if kind == "ints":
        assert isinstance(value, (list, tuple))
        return [int(v) for v in value]
    assert value is None or isinstance(value, (int, str))  # int, bool: JSON as they are
    return value


def _decode(name: str, kind: str, value: object) -> RebuildArg:
    """One field from JSON, or ValueError; a class or dtype only from its allow-list."""
    if kind == "class":
        table = _classes()
        allowed = {
            "tensor_cls": ("torch.Tensor", "torch.nn.parameter.Parameter"),
            "storage_cls": ("torch.storage.TypedStorage",),
        }[name]
        if value not in allowed:
            raise ValueError(f"CUDA IPC handle: {name} {value!r} is not one of {list(allowed)}")
        return table[value]
    if kind == "dtype":
        dtypes = _dtypes()
        if not isinstance(value, str) or value not in dtypes:
            raise ValueError(f"CUDA IPC handle: unknown dtype {value!r}")
        return dtypes[value]
    if kind == "bytes":
        if value is None:
            return None
        try:
            return base64.b64decode(value, validate=True)  # type: ignore[arg-type]  # not text: TypeError
        except (TypeError, ValueError):
            raise ValueError(f"CUDA IPC handle: {name} must be base64 text") from None
    if kind == "ints":
        if not isinstance(value, list) or not all(type(v) is int and v >= 0 for v in value):
            raise ValueError(f"CUDA IPC handle: {name} must be a list of non-negative integers")
        if name == "tensor_size":
            import torch

            return torch.Size(value)
        return tuple(value)
    if kind == "int":
        if type(value) is not int or value < 0:
            raise ValueError(f"CUDA IPC handle: {name} must be a non-negative integer")
        return value
    if type(value) is not bool:
        raise ValueError(f"CUDA IPC handle: {name} must be true or false")
    return value


def encode_handle(tensor: torch.Tensor) -> str:
    """A JSON string another process on this machine turns back into ``tensor`` with :func:`open_handle`.

    ``tensor`` must be a dense CUDA tensor; it must stay alive until the
    receiver has opened the handle (torch's CUDA IPC rules).
    """
    from torch.multiprocessing import reductions

    rebuild, args = reductions.reduce_tensor(tensor)
    if rebuild is not reductions.rebuild_cuda_tensor:
        raise ValueError(f"only dense CUDA tensors have a CUDA IPC handle (torch would use {rebuild.__name__})")
    if len(args) != len(FIELDS):
        raise ValueError(f"rebuild_cuda_tensor takes {len(FIELDS)} arguments here, torch gave {len(args)}")
    fields = {name: _encode(kind, value) for (name, kind), value in zip(FIELDS, args)}
    for name in ("tensor_cls", "storage_cls"):
        _decode(name, "class", fields[name])  # fail here, not in the receiver
    return json.dumps({"cuda_ipc": _VERSION, **fields}, separators=(",", ":"))


def decode_handle(handle: str) -> tuple[RebuildArg, ...]:
    """The ``rebuild_cuda_tensor`` arguments in ``handle``; ValueError if it is anything else."""
    try:
        data = json.loads(handle)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"CUDA IPC handle is not JSON: {exc}") from None
    expected = {"cuda_ipc", *(name for name, _ in FIELDS)}
    if not isinstance(data, dict) or set(data) != expected or data["cuda_ipc"] != _VERSION:
        raise ValueError(f"CUDA IPC handle must have exactly the fields {sorted(expected)} (version {_VERSION})")
    return tuple(_decode(name, kind, data[name]) for name, kind in FIELDS)


def open_handle(handle: str) -> torch.Tensor:
    """The CUDA tensor described by an :func:`encode_handle` string (shares the sender's memory)."""
    from torch.multiprocessing import reductions

    return reductions.rebuild_cuda_tensor(*decode_handle(handle))


__all__ = ["FIELDS", "decode_handle", "encode_handle", "open_handle"]
