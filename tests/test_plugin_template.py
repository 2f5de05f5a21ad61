"""The plugin promise: plugin distributions install on their own next to rlcore and pass the conformance kit,
unchanged: the plugin template and the tensor-parallel example, a frozen plugin of plugin API version 1
(``tests/fixtures/plugin-v1``) and a third party's backend of version 5 (``tests/fixtures/plugin-v5``), as they
were written then. Their specs' ``plugin_api_version`` is accepted and ignored since the versions were retired.

Each is copied out of the repository, pip-installed (no dependencies: rlcore
and torch come from this environment) into a private directory, and its own
test suite runs in a fresh interpreter that sees only that directory on top of
this environment: no path or import reaches back into this repo.
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

REPO = Path(__file__).resolve().parents[1]
#: Kit tests every plugin must pass (a guard against a vacuous pass: everything skipped because the package was
#: not importable).
MUST_PASS = ["test_plugin_module_is_light", "test_spec_is_valid", "test_logprobs_match_hf[world]",
             "test_train_steps_match_single_process[world]", "test_reference_logprobs_after_training",
             "test_checkpoint_round_trip"]
#: (source directory, backend name, distribution, plugin_api_version its spec declares, kit tests it must pass,
#: the ``-k`` selection of its own tests that runs: None = all)
PLUGINS = [
    (REPO / "examples" / "plugin-template", "template", "rlcore-plugin-template", 2,
     [*MUST_PASS, "test_train_steps_match_single_process[dynamic]", "test_data_is_sharded_by_the_declared_layout"],
     None),
    # plugin API 1, frozen as it was written (its kit tests of then, on today's kit and core)
    (REPO / "tests" / "fixtures" / "plugin-v1", "v1", "rlcore-plugin-v1-frozen", None,
     [*MUST_PASS, "test_train_steps_match_single_process[dynamic]"], None),
    # its own tensor-parallel layout: tp 2 × dp 2, against the single-process oracle and a 1-rank policy
    (REPO / "examples" / "plugin-tp", "tpexample", "rlcore-plugin-tp", 2,
     [*MUST_PASS, "test_train_steps_match_single_process[single]", "test_data_is_sharded_by_the_declared_layout"],
     None),
    # plugin API 5, as a third party wrote it: chunked logprobs, and logits at indices (the kit's distillation
    # step joins every train-step test). Only what version 5 added runs beyond MUST_PASS: the rest is the template's.
    (REPO / "tests" / "fixtures" / "plugin-v5", "v5", "rlcore-plugin-v5-thirdparty", 5,
     [*MUST_PASS, "test_logprobs_match_hf[chunked]", "test_train_steps_match_single_process[chunked]"],
     "test_plugin_module_is_light or test_spec_is_valid or test_reference_logprobs_after_training or "
     "test_checkpoint_round_trip or ((test_logprobs_match_hf or test_train_steps_match_single_process) and "
     "(world or chunked))"),
]


def _run(args: list[str], cwd: Path, site: Path, timeout: float) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RLCORE_PLUGINS", "RLCORE_DISABLE_PLUGINS")}
    env["PYTHONPATH"] = str(site)
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("plugin, backend, distribution, api, must_pass, select", PLUGINS,
                         ids=[p[1] for p in PLUGINS])
def test_plugin_installs_and_passes_the_kit(tmp_path, plugin, backend, distribution, api, must_pass, select):
    source = tmp_path / plugin.name
    shutil.copytree(plugin, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__",
                                                                  ".pytest_cache"))
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(site), str(source)], check=True, capture_output=True, text=True)

    listed = _run(["-m", "rlcore", "backends", "list", "--json"], tmp_path, site, timeout=120)
    assert listed.returncode == 0, listed.stderr
    rows = {r["name"]: r for r in json.loads(listed.stdout)["backends"]}
    assert rows[backend]["status"] == "ok", rows[backend]
    assert (rows[backend]["distribution"], rows[backend]["plugin_api_version"]) == (distribution, api)

    report = tmp_path / "report.xml"
    run = _run(["-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", "tests",
                *(["-k", select] if select else [])], source, site, timeout=600)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    outcomes = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        skipped = case.find("skipped") is not None
        outcomes[case.get("name")] = "skipped" if skipped else "passed"
    assert all(outcomes.get(name) == "passed" for name in must_pass), outcomes
