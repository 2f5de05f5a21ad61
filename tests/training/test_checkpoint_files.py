"""A checkpoint reads its own files only (rlcore.training.checkpoint_files), and a Policy refuses one
that does not before any worker starts. The backends' loaders are checked in each plugin's
untrusted-checkpoint tests."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from rlcore.training.checkpoint_files import OutsideCheckpointError, check_inside, outside_files


def _checkpoint(root: Path) -> Path:
    """A sharded-looking HF checkpoint: two weight files and their index."""
    ckpt = root / "step_3" / "weights"
    ckpt.mkdir(parents=True)
    for part in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        (ckpt / part).write_bytes(b"weights")
    _index(ckpt, {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"})
    return ckpt


def _index(ckpt: Path, weight_map: dict) -> None:
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_a_genuine_checkpoint_and_links_that_stay_inside_pass(tmp_path: Path) -> None:
    ckpt = _checkpoint(tmp_path)
    (ckpt / "sub").mkdir()
    os.symlink("../model-00001-of-00002.safetensors", ckpt / "sub" / "alias.safetensors")
    os.symlink(ckpt, tmp_path / "latest")  # the directory itself may be a link
    assert outside_files(ckpt) == [] and outside_files(tmp_path / "latest") == []
    check_inside(ckpt)


@pytest.mark.parametrize("entry", ["../../elsewhere/model.safetensors", "ABSOLUTE", "sub/../../x.safetensors"])
def test_an_index_entry_outside_is_named_with_where_it_points(tmp_path: Path, entry: str) -> None:
    ckpt = _checkpoint(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "model.safetensors").write_bytes(b"someone else's weights")
    entry = str(elsewhere / "model.safetensors") if entry == "ABSOLUTE" else entry
    _index(ckpt, {"a": "model-00001-of-00002.safetensors", "b": entry})
    (line,) = outside_files(ckpt)
    target = os.path.realpath(ckpt / entry)
    assert line.startswith(
        f"{ckpt.resolve() / 'model.safetensors.index.json'} names the weight file {entry!r}, "
        f"which is {target}, outside the checkpoint {ckpt.resolve()}; "
    ), line
    with pytest.raises(OutsideCheckpointError, match="outside the checkpoint"):
        check_inside(ckpt)


@pytest.mark.parametrize("what", ["file", "directory", "dangling"])
def test_a_link_out_of_the_checkpoint_is_refused(tmp_path: Path, what: str) -> None:
    ckpt = _checkpoint(tmp_path)
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "id_rsa").write_text("key")
    link = ckpt / ("extra_state.pt" if what != "directory" else "optimizer")
    os.symlink({"file": secret / "id_rsa", "directory": secret, "dangling": "/nonexistent/x"}[what], link)
    (line,) = outside_files(ckpt)
    assert line.startswith(f"{ckpt.resolve() / link.name} is a link to ") and "outside the checkpoint" in line, line
    assert "copy them into it, or resume from another checkpoint" in line


def test_policy_sources_name_the_field_before_any_worker_starts(tmp_path: Path, tiny_model_dir: str) -> None:
    """``Policy`` runs this check before it starts workers (and ``rlcore run --resume`` before Ray)."""
    import shutil

    from rlcore.config import load_config_dict
    from rlcore.preflight import check_policy_sources

    weights, optimizer = tmp_path / "weights", tmp_path / "optimizer"
    shutil.copytree(tiny_model_dir, weights)
    optimizer.mkdir()
    (tmp_path / "other.pt").write_bytes(b"x")
    os.symlink(tmp_path / "other.pt", optimizer / "extra_state.pt")
    policy = load_config_dict({"policy": {"model_name": tiny_model_dir}}).policy
    assert check_policy_sources(policy, weights, tmp_path / "weights") == []
    (problem,) = check_policy_sources(policy, weights, optimizer)
    assert problem.startswith(f"optimizer_path: {optimizer.resolve() / 'extra_state.pt'} is a link to "), problem
