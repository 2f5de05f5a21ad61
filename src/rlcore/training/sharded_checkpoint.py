"""Optimizer state of a sharded model (FSDP2, FSDP1) in torch distributed checkpointing (DCP).

Each rank writes only its own shards, so no rank ever holds the full
optimizer state, and DCP reshards on load (a checkpoint loads at any
data-parallel size). Weights go to HF safetensors separately
(:func:`save_gathered`). Imported by workers
only (it imports torch.distributed).

Every save is atomic (design.md §2.8): rank 0 opens an
``rlcore.training.checkpoint.atomic_directory`` (a temporary sibling of the
target), every rank writes its part into it, and rank 0 publishes it with a
rename once all ranks are done. A crash at any point leaves the previous
checkpoint whole.

Nothing is loaded with unrestricted pickle (a checkpoint is untrusted input,
design.md §2.8; see :mod:`rlcore.safe_pickle`): optimizer *tensors* go through
torch distributed checkpointing (DCP), whose tensor files torch reads with
``weights_only=True``; the non-tensor values (hyperparameters in
``param_groups``, the LR scheduler) go to a small ``torch.save`` file read
back with ``weights_only=True``. Two DCP reads are replaced: the ``.metadata``
index, which torch reads with plain ``pickle``, is read with an exact
allow-list of DCP's metadata classes (:class:`SafeFileSystemReader`); and
non-tensor entries, which DCP's default planner would ``torch.load`` with
``weights_only=False``, are refused (:class:`TensorsOnlyLoadPlanner`): these
checkpoints hold only tensors, so a metadata file that says otherwise is forged.
"""

from __future__ import annotations

import collections
import contextlib
import io
import pickle
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from rlcore.safe_pickle import UnsafeCheckpointError, exact_torch_safe_globals, read_dcp_metadata, refused_by_torch
from rlcore.training.checkpoint import atomic_directory, load_torch_state, save_hf_checkpoint, save_torch_state
from rlcore.training.checkpoint_files import OutsideCheckpointError, check_inside

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


# --------------------------------------------------------------------------- safe DCP reads


class DamagedCheckpointError(ValueError):
    """A checkpoint file cannot be read: truncated, replaced or corrupt."""


@contextlib.contextmanager
def dcp_errors_in_words(path: str | Path) -> Iterator[None]:
    """A failed DCP read as one line of what happened.

    DCP raises a rank's failure as a ``CheckpointException``: a ``BaseException``
    (``except Exception`` misses it) whose text is every rank's traceback. The
    first rank's cause is raised instead: a refusal as it is, anything else as a
    :class:`DamagedCheckpointError` naming the directory.
    """
    try:
        yield
    except (CheckpointException, EOFError, pickle.UnpicklingError) as exc:
        cause = next(iter(exc.failures.values()), exc) if isinstance(exc, CheckpointException) else exc
        cause = cause[0] if isinstance(cause, tuple) else cause  # (exception, traceback) per rank
        if isinstance(cause, (UnsafeCheckpointError, OutsideCheckpointError, DamagedCheckpointError)):
            raise cause from None
        if isinstance(cause, pickle.UnpicklingError):  # torch's weights-only refusal of a tensor's data
            raise UnsafeCheckpointError(f"{path}: refusing to load {refused_by_torch(cause)}") from None
        detail = (str(cause).splitlines() or ["the file ends early" if isinstance(cause, EOFError) else "no detail"])[
            0
        ][:160]
        raise DamagedCheckpointError(
            f"{path}: damaged, cannot be read ({type(cause).__name__}: {detail}); resume from another checkpoint"
        ) from None


class SafeFileSystemReader(dcp.FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` is read with an exact allow-list (:func:`read_dcp_metadata`)."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        return read_dcp_metadata(self, kwargs.get("rank"))


class TensorsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, except that a non-tensor entry is refused instead of unpickled.

    The default ``load_bytes`` is ``torch.load(weights_only=False)``; it runs
    when the metadata calls an entry bytes, whatever the state dict expects.
    """

    def __init__(self, source: str) -> None:
        super().__init__()
        self.source = source

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise UnsafeCheckpointError(
            f"{self.source}: refusing to unpickle {read_item.dest_index.fqn!r} "
            "(these optimizer checkpoints hold only tensors)"
        )


# --------------------------------------------------------------------------- optimizer state


def _split(flat: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}
    return tensors, {k: v for k, v in flat.items() if k not in tensors}


def save_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, path: str) -> None:
    """Write optimizer (sharded, DCP) and scheduler state to directory ``path`` atomically. Collective.

    A never-stepped optimizer is saved as None (and restored as a fresh one):
    torch's ``get_optimizer_state_dict`` would first initialise its state by
    stepping with zero gradients, and Adam's step count of 1 would change the
    next real step.
    """
    stepped = bool(optimizer.state)
    tensors, extra = _split(get_optimizer_state_dict(model, optimizer, options=_FLAT)) if stepped else ({}, None)
    with collective_atomic_directory(path) as tmp:
        if stepped:
            dcp.save(tensors, storage_writer=dcp.FileSystemWriter(str(tmp)))
        if dist.get_rank() == 0:
            save_torch_state(
                {"optimizer": extra, "scheduler": scheduler.state_dict() if scheduler else None}, tmp / EXTRA_STATE_NAME
            )


def load_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, path: str) -> None:
    """Load what :func:`save_optimizer` wrote into this rank's optimizer shards. Collective.

    The optimizer's current state dict is the template DCP loads into (torch
    initialises empty optimizer state for it), so each rank reads only its shards.
    """
    if not Path(path).is_dir():
        raise FileNotFoundError(
            f"{path}: expected an optimizer checkpoint directory (DCP shards + "
            f"{EXTRA_STATE_NAME}); a single-file optimizer state is not this format"
        )
    check_inside(path)
    extra = load_torch_state(Path(path) / EXTRA_STATE_NAME)
    if scheduler is not None and extra["scheduler"] is not None:
        scheduler.load_state_dict(extra["scheduler"])
    if extra["optimizer"] is None:  # saved before the first step: a fresh optimizer
        optimizer.state.clear()
        return
    tensors, _ = _split(get_optimizer_state_dict(model, optimizer, options=_FLAT))
    reader = SafeFileSystemReader(path)
    # tensor files: torch's own weights-only allow-list, nothing added
    with exact_torch_safe_globals(), dcp_errors_in_words(path):
        reader.read_metadata()  # a refused index raises whole here, not folded into DCP's own error text
        dcp.load(tensors, storage_reader=reader, planner=TensorsOnlyLoadPlanner(str(path)))
    set_optimizer_state_dict(model, optimizer, {**tensors, **extra["optimizer"]}, options=_FLAT)


def on_rank0(fn: Callable[[], Any]) -> None:
    """Run ``fn`` on rank 0, then synchronise (a failure on rank 0 still raises there)."""
    if dist.get_rank() == 0:
        fn()
    dist.barrier()


def save_gathered(tensors: Iterable[tuple[str, torch.Tensor]], hf_config: Any, path: str) -> None:
    """HF safetensors of a sharded model, one gathered tensor at a time. Collective.

    Every rank iterates ``tensors`` (each step is a gather); rank 0 writes
    them as they come (:func:`save_hf_checkpoint`), holding at most one shard.
    """
    if dist.get_rank() == 0:
        save_hf_checkpoint(tensors, hf_config, path)
    else:
        collections.deque(tensors, maxlen=0)
    dist.barrier()
