"""The plugin promise: plugin distributions install on their own next to rlcore and pass the conformance kit,
unchanged: the plugin template and the tensor-parallel example, a frozen plugin of plugin API version 1
(``tests/fixtures/plugin-v1``) and a third party's backend of version 5 (``tests/fixtures/plugin-v5``), as they
were written then. The frozen ones' specs declare the retired ``plugin_api_version``: it is accepted, ignored,
and still shown by ``rlcore backends list --json``; the template and the example declare none.

Each is copied out of the repository and pip-installed (no dependencies: rlcore
and torch come from this environment) into a private directory shared by the
four (their packages, entry points and backend names differ), and their own
test suites run in one fresh interpreter that sees only that directory on top
of this environment: no path or import reaches back into this repo. One
interpreter and one Ray session for the four suites (not four) keeps this
file's cost to the suites themselves; each plugin's outcomes are read apart
from the others' in the JUnit report.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
#: Kit tests every plugin must pass (a guard against a vacuous pass: everything skipped because the package was
#: not importable).
MUST_PASS = [
    "test_plugin_module_is_light",
    "test_spec_is_valid",
    "test_logprobs_match_hf[world]",
    "test_train_steps_match_single_process[world]",
    "test_reference_logprobs_after_training",
    "test_checkpoint_round_trip",
]
#: (source directory, backend name, distribution, plugin_api_version its spec declares (retired: the template
#: and the example leave it out), kit tests it must pass,
#: the ``-k`` selection of its own tests that runs: None = all)
PLUGINS = [
    (
        REPO / "examples" / "plugin-template",
        "template",
        "rlcore-plugin-template",
        None,
        [*MUST_PASS, "test_train_steps_match_single_process[dynamic]", "test_data_is_sharded_by_the_declared_layout"],
        None,
    ),
    # plugin API 1, frozen as it was written (its kit tests of then, on today's kit and core)
    (
        REPO / "tests" / "fixtures" / "plugin-v1",
        "v1",
        "rlcore-plugin-v1-frozen",
        None,
        [*MUST_PASS, "test_train_steps_match_single_process[dynamic]"],
        None,
    ),
    # its own tensor-parallel layout: tp 2 × dp 2, against the single-process oracle and a 1-rank policy
    (
        REPO / "examples" / "plugin-tp",
        "tpexample",
        "rlcore-plugin-tp",
        None,
        [*MUST_PASS, "test_train_steps_match_single_process[single]", "test_data_is_sharded_by_the_declared_layout"],
        None,
    ),
    # plugin API 5, as a third party wrote it: chunked logprobs, and logits at indices (the kit's distillation
    # step joins every train-step test). Only what version 5 added runs beyond MUST_PASS: the rest is the template's.
    (
        REPO / "tests" / "fixtures" / "plugin-v5",
        "v5",
        "rlcore-plugin-v5-thirdparty",
        5,
        [*MUST_PASS, "test_logprobs_match_hf[chunked]", "test_train_steps_match_single_process[chunked]"],
        "test_plugin_module_is_light or test_spec_is_valid or test_reference_logprobs_after_training or "
        "test_checkpoint_round_trip or ((test_logprobs_match_hf or test_train_steps_match_single_process) and "
        "(world or chunked))",
    ),
]


def _run(args: list[str], cwd: Path, site: Path, timeout: float) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RLCORE_PLUGINS", "RLCORE_DISABLE_PLUGINS")}
    env["PYTHONPATH"] = str(site)
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _folder(backend: str) -> str:
    """The copy's directory name: also the first part of its tests' JUnit class names and ``-k`` names."""
    return f"kit_{backend}"


@pytest.fixture(scope="module")
def kits(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The four copied, installed in one pip call, listed once, and their suites run in one pytest process."""
    root = tmp_path_factory.mktemp("plugin-kits")
    sources = []
    for plugin, backend, *_ in PLUGINS:
        sources.append(root / _folder(backend))
        shutil.copytree(
            plugin, sources[-1], ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", ".pytest_cache")
        )
    site = root / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(site),
            *map(str, sources),
        ],
        check=True,
        capture_output=True,
        text=True,
    )

    listed = _run(["-m", "rlcore", "backends", "list", "--json"], root, site, timeout=120)
    assert listed.returncode == 0, listed.stderr

    # A plugin's own ``-k`` selection applies to its folder only.
    select = " and ".join(f"(not {_folder(backend)} or ({expr}))" for _, backend, *_, expr in PLUGINS if expr)
    report = root / "report.xml"
    # importlib: the four suites' same-named modules (tests/test_conformance.py, conftest.py) import side by side.
    run = _run(
        [
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--import-mode=importlib",
            f"--rootdir={root}",
            f"--junitxml={report}",
            *(str(source / "tests") for source in sources),
            *(["-k", select] if select else []),
        ],
        root,
        site,
        timeout=1800,
    )
    outcomes: dict[str, dict[str, str]] = {_folder(backend): {} for _, backend, *_ in PLUGINS}
    if report.exists():
        for case in ET.parse(report).getroot().iter("testcase"):
            kind = next((k for k in ("failure", "error", "skipped") if case.find(k) is not None), "passed")
            outcomes.setdefault(case.get("classname", "").split(".")[0], {})[case.get("name")] = kind
    return {"backends": {r["name"]: r for r in json.loads(listed.stdout)["backends"]}, "run": run, "outcomes": outcomes}


@pytest.mark.parametrize("plugin, backend, distribution, api, must_pass, select", PLUGINS, ids=[p[1] for p in PLUGINS])
def test_plugin_installs_and_passes_the_kit(kits, plugin, backend, distribution, api, must_pass, select):
    rows, run = kits["backends"], kits["run"]
    assert rows[backend]["status"] == "ok", rows[backend]
    assert (rows[backend]["distribution"], rows[backend]["plugin_api_version"]) == (distribution, api)

    # 0: all passed; 1: some test failed (this plugin's, or another's: read apart below); else pytest itself failed.
    assert run.returncode in (0, 1), run.stdout[-6000:] + run.stderr[-3000:]
    outcomes = kits["outcomes"][_folder(backend)]
    failed = {name: kind for name, kind in outcomes.items() if kind in ("failure", "error")}
    assert outcomes and not failed, (failed, run.stdout[-6000:] + run.stderr[-3000:])
    assert all(outcomes.get(name) == "passed" for name in must_pass), outcomes
