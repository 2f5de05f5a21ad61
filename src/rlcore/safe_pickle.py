"""Reading pickles from checkpoint directories without running code (design.md §2.8).

A checkpoint directory is untrusted input: users download and share them, and
``rlcore run --resume`` reads whatever is in one. Unpickling calls every global
the file names with arguments the file chooses, so a pickle that may name
``os.system`` (directly, through ``builtins.getattr``, or as a dotted name
under protocol 4) runs code. Every pickle a resume reads goes through here:

- :func:`restricted_loads` for plain pickles, e.g. DCP's ``.metadata``
  (:func:`load_dcp_metadata`): the file may name only the globals of an
  explicit allow-list of exact ``(module, qualified name)`` pairs, each mapped
  to the object it stands for. No module is imported, no dotted name is
  resolved, no attribute is looked up; anything else is refused with an
  :class:`UnsafeCheckpointError` naming the file and the global.
- :func:`torch_load` for ``torch.save`` files: torch's ``weights_only``
  unpickler with exactly the globals the caller lists on top of torch's own
  (tensors, storages, dtypes, containers). Libraries widen that list for the
  whole process (megatron-core registers sixteen classes when imported), so
  those are set aside for the call.

torch is imported inside the functions: ``rlcore`` stays importable without it.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

#: ``(module, qualified name)`` as a pickle's GLOBAL / STACK_GLOBAL names it → the object it stands for.
AllowList = Mapping[tuple[str, str], Any]


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint file names something that is not plain checkpoint data; nothing of it was run."""


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that resolves globals only through an exact allow-list (and refuses persistent ids)."""

    def __init__(self, file: Any, allowed: AllowList, source: str) -> None:
        super().__init__(file)
        self._allowed = allowed
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._allowed[(module, name)]
        except KeyError:
            raise UnsafeCheckpointError(
                f"{self._source}: refusing to load {module}.{name} (not an allowed checkpoint type)"
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError(f"{self._source}: refusing a persistent reference (no tensors expected here)")


def restricted_loads(data: bytes, allowed: AllowList, source: str) -> Any:
    """Unpickle ``data`` admitting only the globals in ``allowed``; ``source`` (a path) names it in errors."""
    return RestrictedUnpickler(io.BytesIO(data), allowed, source).load()


# --------------------------------------------------------------------------- torch.save files


@contextlib.contextmanager
def exact_torch_safe_globals(allowed: Iterable[Any] = ()) -> Iterator[None]:
    """For the block, torch's ``weights_only`` allow-list is its defaults plus exactly ``allowed``.

    What other code added process-wide with ``torch.serialization.add_safe_globals``
    is set aside and put back afterwards. Mutates process state: not for use
    while another thread calls ``torch.load``.
    """
    from torch import serialization

    saved = serialization.get_safe_globals()
    serialization.clear_safe_globals()
    try:
        serialization.add_safe_globals(list(allowed))
        yield
    finally:
        serialization.clear_safe_globals()
        serialization.add_safe_globals(saved)


def refused_by_torch(exc: Exception) -> str:
    """What torch's weights-only unpickler refused, from its error message (without torch's advice)."""
    text = str(exc)
    found = re.search(r"GLOBAL (\S+)", text)
    if found:
        return f"{found.group(1)} (not an allowed checkpoint type)"
    detail = text.split("WeightsUnpickler error:")[-1].split("Check the documentation")[0].strip()
    return f"it ({detail.splitlines()[-1] if detail else 'not plain checkpoint data'})"


def torch_load(file: Any, source: str, allowed: Iterable[Any] = (), mmap: bool = False) -> Any:
    """``torch.load`` onto CPU with ``weights_only=True`` and exactly ``allowed`` beyond torch's defaults.

    ``file`` is a path or a binary file object; ``source`` names it in errors. ``mmap``: map the tensors'
    storage instead of reading it (zip-format files only: a check that reads the pickle alone).
    A refusal raises :class:`UnsafeCheckpointError` naming the file and what was refused.
    """
    import torch

    with exact_torch_safe_globals(allowed):
        try:
            return torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
        except pickle.UnpicklingError as exc:
            raise UnsafeCheckpointError(f"{source}: refusing to load {refused_by_torch(exc)}") from exc


# --------------------------------------------------------------------------- DCP metadata


def _layout(name: Any) -> Any:
    """Stands in for ``torch.serialization._get_layout`` (how a ``torch.layout`` pickles): a name lookup only."""
    import torch

    layouts = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}
    if not isinstance(name, str) or name not in layouts:
        raise UnsafeCheckpointError(f"unknown tensor layout {name!r}")
    return layouts[name]


def dcp_metadata_globals() -> dict[tuple[str, str], Any]:
    """The globals a DCP ``.metadata`` written by torch 2.13 (plain DCP or megatron-core 0.16) names.

    Found by listing the globals of real files (rl-dtensor optimizer state;
    megatron model + optimizer at TP 1 and 2). All are dataclasses or enums
    holding plain values, plus ``torch.Size``, dtypes and layouts by exact name,
    and ``pathlib.PosixPath`` (``StorageMeta.checkpoint_id``).
    """
    import pathlib

    import torch
    from torch.distributed.checkpoint import filesystem, metadata, planner

    dcp = "torch.distributed.checkpoint"
    allowed: dict[tuple[str, str], Any] = {
        (f"{dcp}.metadata", "Metadata"): metadata.Metadata,
        (f"{dcp}.metadata", "MetadataIndex"): metadata.MetadataIndex,
        (f"{dcp}.metadata", "StorageMeta"): metadata.StorageMeta,
        (f"{dcp}.metadata", "TensorStorageMetadata"): metadata.TensorStorageMetadata,
        (f"{dcp}.metadata", "BytesStorageMetadata"): metadata.BytesStorageMetadata,
        (f"{dcp}.metadata", "ChunkStorageMetadata"): metadata.ChunkStorageMetadata,
        (f"{dcp}.metadata", "TensorProperties"): metadata.TensorProperties,
        (f"{dcp}.metadata", "_MEM_FORMAT_ENCODING"): metadata._MEM_FORMAT_ENCODING,
        (f"{dcp}.filesystem", "_StorageInfo"): filesystem._StorageInfo,
        # megatron-core keeps every rank's save plan in the metadata (``all_local_plans``)
        (f"{dcp}.planner", "SavePlan"): planner.SavePlan,
        (f"{dcp}.planner", "WriteItem"): planner.WriteItem,
        (f"{dcp}.planner", "WriteItemType"): planner.WriteItemType,
        (f"{dcp}.planner", "TensorWriteData"): planner.TensorWriteData,
        ("torch", "Size"): torch.Size,
        ("torch.serialization", "_get_layout"): _layout,
        ("pathlib", "PosixPath"): pathlib.PosixPath,
    }
    allowed.update(
        {("torch", str(v).removeprefix("torch.")): v for v in vars(torch).values() if isinstance(v, torch.dtype)}
    )
    return allowed


def _plain_file_name(name: Any) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..") and not any(c in name for c in "/\\\0")


def load_dcp_metadata(data: bytes, source: str) -> Any:
    """A DCP ``Metadata`` from the bytes of a ``.metadata`` file, admitting only :func:`dcp_metadata_globals`.

    Also checks that every storage file it points to is a plain file name in
    the checkpoint directory (no ``../``, no absolute path).
    """
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata

    metadata = restricted_loads(data, dcp_metadata_globals(), source)
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"{source}: not DCP metadata (holds a {type(metadata).__name__})")
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        raise UnsafeCheckpointError(f"{source}: malformed DCP metadata (storage_data is a {type(storage).__name__})")
    for index, info in storage.items():
        if not isinstance(info, _StorageInfo) or not _plain_file_name(info.relative_path):
            raise UnsafeCheckpointError(
                f"{source}: the data of {getattr(index, 'fqn', index)!r} is not in a file of the checkpoint directory"
            )
    return metadata


def read_dcp_metadata(reader: Any, rank: int | None = None) -> Any:
    """What ``FileSystemReader.read_metadata`` returns, with the file read by :func:`load_dcp_metadata`.

    For ``read_metadata`` overrides of ``torch.distributed.checkpoint.FileSystemReader``
    subclasses (torch itself reads the file with plain ``pickle.load``).
    """
    from torch.distributed.checkpoint.metadata import StorageMeta

    path = reader._get_metadata_path(rank)
    with reader.fs.create_stream(path, "rb") as f:
        metadata = load_dcp_metadata(f.read(), str(path))
    if metadata.storage_meta is None:
        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.load_id = reader.load_id
    return metadata


__all__ = [
    "RestrictedUnpickler",
    "UnsafeCheckpointError",
    "dcp_metadata_globals",
    "exact_torch_safe_globals",
    "load_dcp_metadata",
    "read_dcp_metadata",
    "refused_by_torch",
    "restricted_loads",
    "torch_load",
]
