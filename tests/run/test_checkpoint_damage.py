"""A damaged or reaching-out checkpoint is refused in one line before Ray starts (issue 44, items 12 and 13): a
``state.json`` that cannot be read (it was a raw ``JSONDecodeError`` traceback), and a ``weights/`` directory that
is a link out of its step directory (it was followed: training resumed from the outside files). Only the step
directory itself may be a link (``latest -> step_000001``). The checkpoints are written by the run's own
``save_step`` (:func:`tests.run.test_output_dir_owner.first_run`)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from rlcore.config import load_config
from rlcore.run.checkpoints import DamagedCheckpoint, read_state, resume_problems
from rlcore.run.train import latest_checkpoint, resume_refusals
from tests.run.test_output_dir_owner import BEFORE_RAY_S, fingerprint, first_run, rlcore_without_ray

REPO = Path(__file__).resolve().parents[2]
SFT_EXAMPLE = REPO / "examples" / "sft_tiny.yaml"
ADVICE = "move {step} away to resume from the step before it, or start fresh in another logger.output_dir"


@pytest.fixture
def run(tmp_path: Path, tiny_model_dir: str) -> Any:
    """The SFT example's config, with a run's files (step checkpoints 0 and 1) in its output directory."""
    cfg = load_config(SFT_EXAMPLE, [f"logger.output_dir={tmp_path / 'run'}"])
    first_run(cfg, tiny_model_dir)
    assert resume_refusals(cfg) == []  # genuine: it resumes
    return cfg


def steps(cfg: Any) -> Path:
    return Path(cfg.logger.output_dir) / "checkpoints"


def decode_error(content: bytes) -> str:
    """What Python's own readers say of ``content`` (the reference the line quotes)."""
    try:
        json.loads(content.decode("utf-8"))
    except ValueError as exc:
        return f"cannot be read ({type(exc).__name__}: {exc})"
    return 'holds no step number (a JSON object with "step": N is expected)'


CUT_SHORT = b'{"step": 1, "data": {"next_b'


@pytest.mark.parametrize("content", [CUT_SHORT, b"", b"\xff\xfe{", b"[1]", b'{"step": "1"}', b'{"data": {}}'])
def test_a_damaged_state_json_is_one_line_naming_the_file_and_what_to_do(run: Any, content: bytes) -> None:
    state = steps(run) / "step_000001" / "state.json"
    state.write_bytes(content)
    why = decode_error(content)
    before = fingerprint(steps(run))
    assert resume_refusals(run) == [f"--resume: {state}: damaged, {why}; {ADVICE.format(step='step_000001')}"]
    with pytest.raises(DamagedCheckpoint, match=r"state.json: damaged"):
        read_state(state.parent)
    assert fingerprint(steps(run)) == before  # nothing repaired or removed behind the user's back
    # the advice holds: with the damaged step moved away, the run resumes from the step before it
    shutil.move(state.parent, Path(run.logger.output_dir) / "step_000001.damaged")
    assert resume_refusals(run) == [] and latest_checkpoint(run) == steps(run) / "step_000000"


def test_a_state_json_whose_step_is_not_its_directory_s_is_refused(run: Any) -> None:
    """``{"step": 10**30}`` in step_000001 resumed, trained nothing and exited 0: the step a checkpoint says
    must be the one its directory names."""
    state = steps(run) / "step_000001" / "state.json"
    state.write_text(json.dumps({"step": 10**30, "data": {"next_batch": 2}}))
    why = f"holds step {10**30}, but its directory is step_000001 (step 1)"
    assert resume_refusals(run) == [f"--resume: {state}: damaged, {why}; {ADVICE.format(step='step_000001')}"]
    state.write_text(json.dumps({"step": 1, "data": {"next_batch": 2}}))
    assert resume_refusals(run) == []


def test_an_older_damaged_state_json_is_found_too(run: Any) -> None:
    """The run reads every step's state.json when it saves (which checkpoints to keep)."""
    state = steps(run) / "step_000000" / "state.json"
    state.write_text("{")
    (line,) = resume_refusals(run)
    assert line.startswith(f"--resume: {state}: damaged, cannot be read (JSONDecodeError: "), line
    assert "move step_000000 away" in line


def test_a_weights_directory_linked_out_of_the_step_is_refused(run: Any, tmp_path: Path) -> None:
    step = steps(run) / "step_000001"
    outside = tmp_path / "elsewhere" / "weights"
    shutil.copytree(step / "weights", outside)  # genuine weights, just not the checkpoint's own
    shutil.rmtree(step / "weights")
    os.symlink(outside, step / "weights")
    fix = "a checkpoint must hold its own files: copy them into it, or resume from another checkpoint"
    assert resume_refusals(run) == [
        f"--resume from {step}: {step.resolve() / 'weights'} is a link to {outside}, outside the checkpoint "
        f"{step.resolve()}; {fix} (or move step_000001 away to resume from the step before it)"
    ]


def test_the_step_directory_itself_may_be_a_link_and_links_inside_it_pass(run: Any) -> None:
    step = steps(run) / "step_000001"
    latest = Path(run.logger.output_dir) / "latest"
    os.symlink(step, latest)
    (step / "weights" / "sub").mkdir()
    os.symlink("../config.json", step / "weights" / "sub" / "config.json")  # stays inside the step
    assert resume_problems(run.policy, latest) == []
    os.symlink(step.parent / "step_000000" / "optimizer", step / "optimizer-of-step-0")  # another step: outside
    (line,) = resume_problems(run.policy, latest)
    assert "optimizer-of-step-0 is a link to " in line and f"outside the checkpoint {step.resolve()}" in line


def test_rlcore_run_resume_with_a_damaged_state_json_says_one_line_before_ray(run: Any, tmp_path: Path) -> None:
    state = steps(run) / "step_000001" / "state.json"
    state.write_bytes(CUT_SHORT)
    before = fingerprint(Path(run.logger.output_dir))
    proc, took = rlcore_without_ray(
        tmp_path, str(SFT_EXAMPLE), "-o", f"logger.output_dir={run.logger.output_dir}", "--resume"
    )
    lines = [ln for ln in proc.stderr.splitlines() if not ln.startswith("notice:")]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines == [f"--resume: {state}: damaged, {decode_error(CUT_SHORT)}; {ADVICE.format(step='step_000001')}"], (
        proc.stderr
    )
    assert took < BEFORE_RAY_S, took
    assert fingerprint(Path(run.logger.output_dir)) == before
    assert json.loads((Path(run.logger.output_dir) / "checkpoints" / "step_000000" / "state.json").read_text())
