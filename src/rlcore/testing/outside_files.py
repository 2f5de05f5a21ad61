"""Checkpoints that reach outside themselves, for the backends' loader tests.

Each case copies a genuine checkpoint (``weights/`` and ``optimizer/``) and makes one file of it
live elsewhere, so that a loader that follows the reference would train on it:

- ``index-parent`` / ``index-absolute``: ``weights/`` has no weight file, only an index whose
  entries name ``../elsewhere/model.safetensors`` / its absolute path;
- ``link-weights``: ``weights/model.safetensors`` is a link to that file;
- ``link-optimizer``: the first file of ``optimizer/`` is a link to a copy outside.

A loader must refuse each with a line naming the file and saying "outside the checkpoint".
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

OUTSIDE_CASES = ("index-parent", "index-absolute", "link-weights", "link-optimizer")


def forge_outside(weights: Path, optimizer: Path, into: Path, case: str) -> tuple[Path, Path]:
    """The ``(weights, optimizer)`` directories of ``case``, built under ``into`` from a genuine pair."""
    from safetensors import safe_open

    new_weights, new_optimizer, elsewhere = into / "weights", into / "optimizer", into / "elsewhere"
    shutil.copytree(weights, new_weights)
    shutil.copytree(optimizer, new_optimizer)
    elsewhere.mkdir()
    if case == "link-optimizer":
        first = sorted(p for p in new_optimizer.rglob("*") if p.is_file())[0]
        outside = elsewhere / first.name
        shutil.move(first, outside)
        os.symlink(outside, first)
        return new_weights, new_optimizer
    outside = elsewhere / "model.safetensors"
    shutil.move(new_weights / "model.safetensors", outside)
    if case == "link-weights":
        os.symlink(outside, new_weights / "model.safetensors")
    else:
        with safe_open(str(outside), framework="pt") as f:
            names = list(f.keys())
        entry = "../elsewhere/model.safetensors" if case == "index-parent" else str(outside)
        index = {"metadata": {}, "weight_map": dict.fromkeys(names, entry)}
        (new_weights / "model.safetensors.index.json").write_text(json.dumps(index))
    return new_weights, new_optimizer


def assert_load_refuses(load: Callable[[Path, Path], object], root: Path, into: Path, case: str) -> None:
    """``load(weights, optimizer)`` of ``case`` (built under ``into`` from ``root/weights`` and
    ``root/optimizer``) raises, naming the file that points outside."""
    weights, optimizer = forge_outside(root / "weights", root / "optimizer", into, case)
    try:
        load(weights, optimizer)
    except Exception as exc:  # noqa: BLE001 - whatever the backend raises, the text must say it
        message = str(exc)
    else:
        raise AssertionError(f"{case}: the load read a checkpoint that reaches outside itself")
    assert "outside the checkpoint" in message and str(into.resolve() / "elsewhere") in message, message


__all__ = ["OUTSIDE_CASES", "assert_load_refuses", "forge_outside"]
