"""The last unclear failures of a run, in rlcore's words (issue 45): a full disk during a save (item 4), a
read-only output directory (item 5), and what ``--resume`` continues from (item 6). No Ray: the error shapes a
save meets are fed to the save, the run's command is driven with its training stubbed out."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from rlcore.run.checkpoints import save_step, step_dir

ROOT = Path(__file__).resolve().parents[2]
SFT_EXAMPLE = ROOT / "examples" / "sft_tiny.yaml"
NO_SPACE = "No space left on device"


class SavingPolicy:
    """Writes a checkpoint's three parts, or raises ``error`` after writing part of the weights."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error

    def save_checkpoint(self, weights: str, optimizer: str, tokenizer: str) -> None:
        for part in (weights, optimizer, tokenizer):
            Path(part).mkdir(parents=True)
            (Path(part) / "data.bin").write_bytes(b"x" * 16)
            if self.error is not None:
                raise self.error


def checkpoint_exception() -> BaseException:
    """torch's error for a DCP save whose ranks hit ENOSPC, as ``dcp.save`` raises it."""
    from torch.distributed.checkpoint.api import CheckpointException

    failures = {rank: (OSError(errno.ENOSPC, NO_SPACE), None) for rank in (0, 1)}
    return CheckpointException("save failed", failures)


def wrapped_by_a_worker(exc: BaseException) -> Exception:
    """What the driver gets from Ray: a worker's error whose text quotes the worker's exception."""
    from rlcore.distributed import WorkerError

    return WorkerError(f"worker lm_policy-0 (rank 0) raised {type(exc).__name__}: {exc}", 0)


@pytest.mark.parametrize(
    "error",
    [
        pytest.param(OSError(errno.ENOSPC, NO_SPACE), id="oserror"),
        pytest.param(checkpoint_exception(), id="torch-checkpoint-exception"),
        pytest.param(wrapped_by_a_worker(checkpoint_exception()), id="worker-error"),
    ],
)
def test_a_full_disk_during_a_save_is_one_line_naming_the_whole_checkpoint(tmp_path, error):
    from rlcore.cli.errors import one_line

    root = tmp_path / "checkpoints"
    save_step(SavingPolicy(), root, 2, keep_last=3)
    with pytest.raises(Exception) as caught:  # noqa: PT011 - which class is the point of the assertion below
        save_step(SavingPolicy(error), root, 4, keep_last=3)
    assert one_line(caught.value) == (
        f"{NO_SPACE} while saving step 4 to {root}; the checkpoint of step 2 is "
        f"whole ({step_dir(root, 2)}); free some space and resume from it with "
        "--resume"
    )
    assert sorted(p.name for p in root.iterdir()) == ["step_000002"]  # the partial save is gone
    assert json.loads((step_dir(root, 2) / "state.json").read_text()) == {"step": 2}


def test_a_full_disk_torch_s_zip_writer_reports_without_an_errno_is_named_as_one(tmp_path):
    """1 of 2 sizes of a save on a full disk failed inside torch's zip writer, whose error has no errno:
    'CheckpointException ranks:dict_keys([0, 1])' with 'unexpected pos 704 vs 598' and 'No space' nowhere."""
    from torch.distributed.checkpoint.api import CheckpointException

    from rlcore.cli.errors import one_line

    short = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    error = wrapped_by_a_worker(CheckpointException("save failed", {0: (short, None), 1: (short, None)}))
    root = tmp_path / "checkpoints"
    save_step(SavingPolicy(), root, 2, keep_last=3)
    with pytest.raises(Exception) as caught:  # noqa: PT011 - which class is the point of the assertion below
        save_step(SavingPolicy(error), root, 4, keep_last=3)
    assert one_line(caught.value) == (
        "No space left on device (torch's checkpoint writer stopped short: unexpected pos 704 vs 598) while saving "
        f"step 4 to {root}; the checkpoint of step 2 is whole ({step_dir(root, 2)}); free some space and resume "
        "from it with --resume"
    )


def test_a_full_disk_at_the_first_save_says_there_is_nothing_to_resume_and_other_errors_pass_through(tmp_path):
    from rlcore.cli.errors import one_line

    root = tmp_path / "checkpoints"
    with pytest.raises(Exception) as caught:  # noqa: PT011
        save_step(SavingPolicy(OSError(errno.EDQUOT, "Disk quota exceeded")), root, 0, keep_last=3)
    assert one_line(caught.value) == (
        f"Disk quota exceeded while saving step 0 to {root}; no earlier step "
        "checkpoint was saved; free some space and run again"
    )
    with pytest.raises(PermissionError, match="denied"):
        save_step(SavingPolicy(PermissionError(errno.EACCES, "Permission denied")), root, 1, keep_last=3)


def under_a_file(tmp_path: Path) -> Path:
    """An output directory no one can create, root included: its parent is a regular file."""
    (tmp_path / "afile").write_text("")
    return tmp_path / "afile" / "out"


def test_an_unwritable_log_directory_sends_the_traceback_to_the_temporary_directory(tmp_path):
    from rlcore.cli.errors import write_traceback

    try:
        raise ValueError("the run's error")
    except ValueError as exc:
        path = write_traceback(exc, under_a_file(tmp_path) / "logs")
    try:
        assert path.parent == Path(tempfile.gettempdir()) and path.name.startswith("rlcore-")
        text = path.read_text()
        assert text.startswith("Traceback (most recent call last):") and "ValueError: the run's error" in text
    finally:
        path.unlink()


def test_an_unwritable_output_directory_stops_the_run_before_ray_in_one_line(tmp_path):
    """The whole command, with a stand-in ``ray`` that fails the run if anything imports it."""
    stub = tmp_path / "stub" / "ray"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ImportError('ray must not be imported')\n")
    out = under_a_file(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(stub.parent), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [sys.executable, "-m", "rlcore", "run", str(SFT_EXAMPLE), "-o", f"logger.output_dir={out}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("notice:")]
    assert proc.returncode == 1
    assert lines == [
        f"logger.output_dir: cannot write {out} ({out.parent} is not a directory); choose a directory "
        "you can write (-o logger.output_dir=...) or make it writable"
    ], proc.stderr


def test_a_read_only_output_directory_is_named_with_the_system_s_words(monkeypatch, tmp_path):
    """Root writes through a chmod 0o555 directory, so the refusal a user meets is made here."""
    import tempfile as tempfile_module

    from rlcore.run.train import output_dir_problems

    def refused(dir, prefix):
        raise PermissionError(errno.EACCES, "Permission denied", str(Path(dir) / f"{prefix}abc"))

    monkeypatch.setattr(tempfile_module, "NamedTemporaryFile", refused)
    cfg = SimpleNamespace(logger=SimpleNamespace(output_dir=str(tmp_path / "out")))
    assert output_dir_problems(cfg) == [
        f"logger.output_dir: cannot write {tmp_path / 'out'} (Permission denied); "
        "choose a directory you can write (-o logger.output_dir=...) or make it "
        "writable"
    ]


def invoke_run(monkeypatch, out: Path, *args: str, train=None):
    """``rlcore run`` of the SFT example into ``out``, its training replaced by ``train`` (no Ray)."""
    from rlcore.cli import run_cmd
    from rlcore.cli.app import app

    monkeypatch.setattr(run_cmd, "train", train or (lambda *a, **k: {"steps": 0}))
    return CliRunner().invoke(app, ["run", str(SFT_EXAMPLE), "-o", f"logger.output_dir={out}", *args])


def test_the_run_s_own_error_handler_falls_back_to_the_temporary_directory(monkeypatch, tmp_path):
    """Were the directory to become unwritable after the check, the error is still two lines, not a traceback."""
    import rlcore.run.train

    monkeypatch.setattr(rlcore.run.train, "output_dir_problems", lambda cfg, *args: [])
    out = under_a_file(tmp_path)
    began = time.time()
    result = invoke_run(monkeypatch, out)
    assert result.exit_code == 1
    error, where = result.stderr.splitlines()[-2:]
    assert error == f"error: NotADirectoryError: [Errno 20] Not a directory: '{out / 'logs'}'"
    path = Path(where.removeprefix("(full traceback in ").partition(",")[0])
    assert where == f"(full traceback in {path}, as {out / 'logs'} cannot be written; -v prints it)"
    assert path.parent == Path(tempfile.gettempdir()) and path.stat().st_mtime >= began - 1
    assert "NotADirectoryError" in path.read_text()
    path.unlink()


def fake_checkpoint(root: Path, step: int) -> None:
    directory = step_dir(root, step)
    directory.mkdir(parents=True)
    (directory / "state.json").write_text(json.dumps({"step": step}))


def test_resume_says_first_which_step_it_resumes_after_and_the_checkpoints_it_found(monkeypatch, tmp_path):
    from rlcore.run.train import resume_line

    out = tmp_path / "run"
    for step in (2, 4):
        fake_checkpoint(out / "checkpoints", step)
    (out / "checkpoints" / ".step_000006.tmp-x").mkdir()  # a save that never completed
    cfg = SimpleNamespace(logger=SimpleNamespace(output_dir=str(out)))
    expected = (
        f"rlcore run: resuming after step 4 (checkpoints: step 2, step 4) from {out / 'checkpoints' / 'step_000004'}"
    )
    assert resume_line(cfg) == expected

    monkeypatch.setattr("rlcore.run.train.resume_refusals", lambda cfg: [])  # the fake checkpoints hold no weights
    resumed = []
    result = invoke_run(monkeypatch, out, "--resume", train=lambda *a, **k: resumed.append(k["resume"]) or {})
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stderr.splitlines() if not line.startswith("notice:")]
    assert lines[0] == expected and lines[1].startswith("rlcore run: SFT with ") and resumed == [True]


def test_a_full_disk_at_any_other_write_is_rlcore_s_line_naming_the_file(tmp_path):
    """Before the start, or writing metrics or logs, a full disk was 'error: OSError: [Errno 28] No space left on
    device'."""
    import shutil

    from rlcore.cli.errors import one_line

    metrics = tmp_path / "run" / "metrics.jsonl"
    try:
        try:
            raise OSError(errno.ENOSPC, NO_SPACE, str(metrics))
        except OSError as exc:
            raise RuntimeError("the run's logger failed") from exc
    except RuntimeError as wrapped:
        line = one_line(wrapped)
    free = shutil.disk_usage(tmp_path).free // 2**20
    assert line.startswith(f"{NO_SPACE} while writing {metrics}, ") and "MiB free there now" in line, line
    assert abs(int(line.split(", ")[1].split()[0]) - free) < 1024  # the disk's own figure, read when it failed
    assert line.endswith(
        "; nothing of the run's checkpoints was changed by it; free some space (or choose logger.output_dir on "
        "another disk) and run again (with --resume to continue from the newest checkpoint)"
    )
    assert one_line(OSError(errno.EACCES, "Permission denied")) == "PermissionError: [Errno 13] Permission denied"


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_a_real_full_device_under_the_metrics_log_is_named_with_its_file(tmp_path):
    """The kernel's own ENOSPC (a write to /dev/full), not a raised one: a flush's error carries no file name,
    so the metrics logger puts its file on it and the run's line names it."""
    from rlcore.cli.errors import one_line
    from rlcore.run.metrics import MetricsLogger

    (tmp_path / "metrics.jsonl").symlink_to("/dev/full")
    logger = MetricsLogger(tmp_path, tensorboard=False, progress_bar=False)
    with pytest.raises(OSError) as caught:
        logger.log(0, {"loss": 1.0})
    line = one_line(caught.value)
    assert line.startswith(f"{NO_SPACE} while writing {tmp_path / 'metrics.jsonl'}, "), line
    assert "free some space" in line
