"""Checkpoints of a sharded model: HF safetensors for weights, DCP for optimizer state.

Every save is atomic (design.md §2.8): rank 0 opens an
``rlcore.training.checkpoint.atomic_directory`` (a temporary sibling of the
target), every rank writes its part into it, and rank 0 publishes it with a
rename once all ranks are done. A crash at any point leaves the previous
checkpoint whole.

Nothing is loaded with unrestricted pickle: optimizer *tensors* go through
torch distributed checkpointing (DCP), whose tensor files are read with
``weights_only=True``; the non-tensor values (hyperparameters in
``param_groups``, the LR scheduler) go to a small ``torch.save`` file read
back with ``weights_only=True``; and DCP's ``.metadata`` index, which torch
reads with plain ``pickle``, is read here with an unpickler that only admits
DCP's own metadata classes.
"""

from __future__ import annotations

import contextlib
import io
import pickle
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from rlcore.training.checkpoint import atomic_directory, load_torch_state, save_torch_state

#: Non-tensor optimizer values and scheduler state, next to the DCP files.
EXTRA_STATE_NAME = "extra_state.pt"
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


@contextlib.contextmanager
def collective_atomic_directory(final_path: str, group: dist.ProcessGroup | None = None):
    """Yield a temporary directory every rank writes into; published atomically when all are done.

    Rank 0 owns the :func:`atomic_directory`; the path is broadcast to the
    other ranks (a shared filesystem is assumed, as DCP assumes it). Nothing
    is published unless every rank reached the closing barrier: if rank 0
    fails, ``atomic_directory`` removes the temporary directory; if another
    rank fails, the worker group kills rank 0 in the barrier, and the stale
    temporary directory is cleared by the next save (``recover_checkpoint``).
    Either way the previous checkpoint stays whole.
    """
    rank = dist.get_rank(group)
    with contextlib.ExitStack() as stack:
        tmp = [str(stack.enter_context(atomic_directory(final_path)))] if rank == 0 else [None]
        dist.broadcast_object_list(tmp, src=0, group=group)
        yield Path(tmp[0])
        dist.barrier(group=group)  # everyone wrote their part before rank 0 publishes
    dist.barrier(group=group)  # published before anyone reads it


# --------------------------------------------------------------------------- safe DCP metadata


class _MetadataUnpickler(pickle.Unpickler):
    """Admits only what a DCP ``.metadata`` file holds: DCP's metadata classes, torch sizes/dtypes, builtins."""

    _MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                "torch.distributed.checkpoint.planner", "torch.distributed.checkpoint._extension")
    _BUILTINS = {"dict", "list", "tuple", "set", "frozenset", "int", "float", "str", "bytes", "bool", "slice",
                 "object", "getattr"}
    _COLLECTIONS = {"OrderedDict", "defaultdict"}
    #: Harmless constructors DCP metadata refers to: layouts by name (a dict lookup), relative paths.
    _OTHERS = {("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
               ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath")}

    def find_class(self, module: str, name: str) -> Any:
        if module in self._MODULES:
            return super().find_class(module, name)
        if module == "builtins" and name in self._BUILTINS:
            return super().find_class(module, name)
        if module == "collections" and name in self._COLLECTIONS:
            return super().find_class(module, name)
        if (module, name) in self._OTHERS:
            return super().find_class(module, name)
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            raise pickle.UnpicklingError("tensors are not allowed in DCP metadata")
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from checkpoint metadata")


class SafeFileSystemReader(dcp.FileSystemReader):
    """``FileSystemReader`` whose metadata is read with :class:`_MetadataUnpickler`."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        from torch.distributed.checkpoint.metadata import StorageMeta

        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(io.BytesIO(f.read())).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


# --------------------------------------------------------------------------- optimizer state


def _split(flat: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}
    return tensors, {k: v for k, v in flat.items() if k not in tensors}


def save_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, path: str) -> None:
    """Write optimizer (sharded, DCP) and scheduler state to directory ``path`` atomically. Collective."""
    tensors, extra = _split(get_optimizer_state_dict(model, optimizer, options=_FLAT))
    with collective_atomic_directory(path) as tmp:
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(str(tmp)))
        if dist.get_rank() == 0:
            save_torch_state({"optimizer": extra, "scheduler": scheduler.state_dict() if scheduler else None},
                             tmp / EXTRA_STATE_NAME)


def load_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, path: str) -> None:
    """Load what :func:`save_optimizer` wrote into this rank's optimizer shards. Collective.

    The optimizer's current state dict is the template DCP loads into (torch
    initialises empty optimizer state for it), so each rank reads only its shards.
    """
    extra = load_torch_state(Path(path) / EXTRA_STATE_NAME)
    tensors, _ = _split(get_optimizer_state_dict(model, optimizer, options=_FLAT))
    dcp.load(tensors, storage_reader=SafeFileSystemReader(path))
    set_optimizer_state_dict(model, optimizer, {**tensors, **extra["optimizer"]}, options=_FLAT)
    if scheduler is not None and extra["scheduler"] is not None:
        scheduler.load_state_dict(extra["scheduler"])


def on_rank0(fn: Callable[[], Any]) -> None:
    """Run ``fn`` on rank 0, then synchronise (a failure on rank 0 still raises there)."""
    if dist.get_rank() == 0:
        fn()
    dist.barrier()
