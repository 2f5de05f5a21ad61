"""A checkpoint reads its own files only.

A checkpoint may come from someone else: a shared run directory, a colleague's step, a download.
Loading it must not read anything outside it. An index entry naming ``../other/model.safetensors``
or ``/home/someone/model.safetensors``, or a symlink pointing out of the directory, would let a
checkpoint read any file of the machine it is loaded on, or another user's weights, and train on
them. So before a load, every symlink under the checkpoint directory and every file an index
names must resolve (``realpath``) inside it. Links that stay inside are fine, and the directory
itself may be a link (``latest -> step_40``): its target is the root.

Only checkpoints are held to this, never ``policy.model_name``: the Hugging Face cache's snapshot
directories are links into its blob store by design.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

#: Indexes that name the files a load opens (``{"weight_map": {tensor: file}}``).
INDEX_SUFFIX = ".index.json"

_FIX = "a checkpoint must hold its own files: copy them into it, or resume from another checkpoint"


class OutsideCheckpointError(ValueError):
    """A file a checkpoint load would read lies outside the checkpoint directory."""


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def outside_files(directory: str | os.PathLike) -> list[str]:
    """One line per file under ``directory`` (link or index entry) that resolves outside it."""
    root = os.path.realpath(directory)
    lines = []
    for dirpath, dirnames, filenames in os.walk(root):  # links to directories are listed, not followed
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            if os.path.islink(path) and not _inside(target := os.path.realpath(path), root):
                lines.append(f"{path} is a link to {target}, outside the checkpoint {root}; {_FIX}")
            elif name.endswith(INDEX_SUFFIX) and os.path.isfile(path):
                lines += _index_problems(Path(path), root)
    return lines


def _index_problems(index: Path, root: str) -> list[str]:
    try:
        weight_map = json.loads(index.read_bytes()).get("weight_map", {})
    except (OSError, ValueError, AttributeError):
        return []  # unreadable or malformed: the loader reports that in its own words
    if not isinstance(weight_map, dict):
        return []
    problems = []
    for file in sorted({f for f in weight_map.values() if isinstance(f, str)}):
        target = os.path.realpath(os.path.join(index.parent, file))
        if os.path.isabs(file) or not _inside(target, root):
            problems.append(
                f"{index} names the weight file {file!r}, which is {target}, outside the checkpoint {root}; {_FIX}"
            )
    return problems


def check_inside(directory: str | os.PathLike) -> None:
    """Raise :class:`OutsideCheckpointError` (one line per file) if a load of ``directory`` would read
    anything outside it."""
    if lines := outside_files(directory):
        raise OutsideCheckpointError("\n".join(lines))


__all__ = ["OutsideCheckpointError", "check_inside", "outside_files"]
