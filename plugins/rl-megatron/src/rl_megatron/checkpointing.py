"""Megatron distributed checkpoints (model + optimizer + scheduler), published atomically.

``megatron.core.dist_checkpointing`` writes each rank's shards of a sharded
state dict into one directory and can load them back under another TP/PP
layout (resharding). It writes in place, so a crash mid-save would leave a
half-written directory where the previous checkpoint was. Here every rank
writes into a temporary sibling directory chosen by rank 0, and rank 0
publishes it with :func:`rlcore.training.checkpoint.atomic_directory`'s
fsync-and-rename swap once all ranks are done: at every instant the path
holds either the previous complete checkpoint or the new one.

Loading goes through :mod:`rl_megatron.safe_load`: a checkpoint directory is
untrusted input (design.md §2.8), and megatron-core's own load reads DCP's
``.metadata`` and every sharded object with unrestricted pickle.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import torch.distributed as dist

#: Written next to the shards: what produced the checkpoint (for humans and error messages).
INFO_NAME = "rlcore_megatron.json"


def save(sharded_state: dict, path: str, info: dict[str, Any]) -> None:
    """Collective: write ``sharded_state`` to ``path`` (a directory) atomically."""
    from megatron.core import dist_checkpointing

    from rlcore.training.checkpoint import atomic_directory

    rank = dist.get_rank()
    with contextlib.ExitStack() as stack:
        tmp = [str(stack.enter_context(atomic_directory(path)))] if rank == 0 else [None]
        dist.broadcast_object_list(tmp, src=0)
        dist_checkpointing.save(sharded_state, tmp[0])
        if rank == 0:
            (Path(tmp[0]) / INFO_NAME).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
        dist.barrier()  # every rank's shards are on disk before rank 0 publishes
    dist.barrier()  # published before anyone moves on (e.g. to load it)


def read_info(path: str) -> dict[str, Any]:
    """Collective: repair ``path`` after a crash mid-publish (rank 0), then read what wrote it."""
    from rlcore.training.checkpoint import recover_checkpoint

    if dist.get_rank() == 0:
        recover_checkpoint(path)  # a crash between the publish renames leaves the old one aside
    dist.barrier()
    info = Path(path) / INFO_NAME
    if not info.exists():
        raise FileNotFoundError(f"{path} is not a megatron checkpoint written by rl-megatron (no {INFO_NAME})")
    return json.loads(info.read_text())


def load(sharded_state: dict, path: str) -> dict:
    """Collective: load ``sharded_state``'s tensors from ``path`` (any TP/PP layout it was saved with).

    Call :func:`read_info` first: it repairs an interrupted publish. Every
    file is read without unrestricted pickle (:mod:`rl_megatron.safe_load`).
    """
    from rl_megatron import safe_load

    return safe_load.load(sharded_state, path)


__all__ = ["INFO_NAME", "load", "read_info", "save"]
