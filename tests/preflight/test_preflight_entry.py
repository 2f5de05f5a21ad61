"""One home for "will this run start?" (issue 51 item 6): ``rlcore run``, ``rlcore config validate`` and
``rlcore doctor`` all call :func:`rlcore.preflight.preflight`, and the old paths still import, warning."""

from __future__ import annotations

import importlib
import sys
import warnings
from pathlib import Path

import pytest
from typer.testing import CliRunner

import rlcore.preflight as preflight_pkg
from rlcore.cli.app import app
from rlcore.preflight import CheckResult, preflight, problem_lines

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "grpo_tiny.yaml"


class Recorder:
    """Stands in for :func:`rlcore.preflight.preflight`: records each call and refuses with one line."""

    def __init__(self) -> None:
        self.calls: list[tuple[object, dict]] = []

    def __call__(self, resolved=None, **options):
        self.calls.append((resolved, options))
        if resolved is None:
            return [CheckResult("python", "fail", "recorded", "nothing to fix")]
        return [CheckResult("data.train.path", "fail", "data.train.path: recorded; a stand-in refusal")]


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    recorded = Recorder()
    monkeypatch.setattr(preflight_pkg, "preflight", recorded)
    return recorded


def test_the_three_commands_call_the_one_entry_point(recorder: Recorder, tmp_path: Path) -> None:
    runner = CliRunner()
    validated = runner.invoke(app, ["config", "validate", str(TINY), "--no-files"])
    assert validated.exit_code == 1 and "data.train.path: recorded; a stand-in refusal" in validated.output
    out = tmp_path / "out"
    ran = runner.invoke(app, ["run", str(TINY), "-o", f"logger.output_dir={out}"])
    assert ran.exit_code == 1 and "data.train.path: recorded; a stand-in refusal" in ran.output
    assert not out.exists()  # refused before anything is written
    doctor = runner.invoke(app, ["doctor", "--timeout", "5"])
    assert doctor.exit_code == 1 and "recorded" in doctor.output and "fix: nothing to fix" in doctor.output
    (validate_cfg, validate_opts), (run_cfg, run_opts), (doctor_cfg, doctor_opts) = recorder.calls
    assert validate_cfg is not None and validate_opts == {"files": False, "sources": {}}
    assert run_cfg is not None and run_opts == {"first": [], "sources": {}}  # no --resume: nothing said first
    assert doctor_cfg is None and doctor_opts == {"timeout_s": 5.0}  # no config: the host and the plugins


def test_config_mode_lines_are_failed_results_named_by_their_key() -> None:
    from rlcore.config import load_config, resolve

    resolved = resolve(load_config(TINY, ["data.train.path=/nonexistent/train.jsonl"]), run=True)
    results = preflight(resolved, first=["--resume: said first"])
    assert [r.name for r in results] == ["--resume", "data.train.path"]
    assert {r.status for r in results} == {"fail"}
    assert problem_lines(results) == [
        "--resume: said first",
        "data.train.path: /nonexistent/train.jsonl does not exist; set data.train.path to a local .jsonl, .json, "
        ".parquet or .csv file, or a directory written by datasets' save_to_disk",
    ]


@pytest.mark.parametrize(
    ("old", "names", "new"),
    [
        ("rlcore.run.preflight", ("run_problems", "code_problems", "file_problems"), "rlcore.preflight.config"),
        ("rlcore.doctor", ("run_checks",), "rlcore.preflight.machine"),
        ("rlcore.doctor", ("CheckResult", "summarize"), "rlcore.preflight.result"),
    ],
)
def test_the_old_paths_import_for_one_release_and_warn(old: str, names: tuple[str, ...], new: str) -> None:
    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    assert any(issubclass(w.category, DeprecationWarning) and "rlcore.preflight" in str(w.message) for w in caught)
    for name in names:
        assert getattr(module, name) is getattr(importlib.import_module(new), name)
