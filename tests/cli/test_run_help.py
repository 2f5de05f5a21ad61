"""``rlcore run --help`` lists the algorithms installed here, read from the registry when the help is shown: a
plugin's algorithm appears beside the built-ins, and showing the help imports no torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

PLUGIN = """
from rlcore.plugins import AlgorithmSpec, hookimpl


@hookimpl
def rlcore_register_algorithms(register):
    register(AlgorithmSpec(name="rft", config_class="collections:Counter", algorithm_class="collections:Counter"))
"""

#: Shows the help twice in one interpreter (the second must not repeat the list), then whether torch came in.
SHOW = """
import json, sys
from typer.testing import CliRunner
from rlcore.cli.app import app
outputs = [CliRunner().invoke(app, ["run", "--help"], terminal_width=400).output for _ in range(2)]
print(json.dumps({"outputs": outputs, "torch": "torch" in sys.modules}))
"""


def show_help(site: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    for var in ("RLCORE_PLUGINS", "RLCORE_DISABLE_PLUGINS"):
        env.pop(var, None)
    out = subprocess.run([sys.executable, "-c", SHOW], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def test_run_help_lists_the_installed_algorithms_without_importing_torch(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "rft_plugin.py").write_text(PLUGIN)
    info = site / "rlcore_rft-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: rlcore-rft\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[rlcore.plugins]\nrft = rft_plugin\n")

    shown = show_help(site)
    first, second = shown["outputs"]
    text = " ".join(first.split())  # rich wraps and pads the lines
    assert "Train with GRPO" not in text
    assert (
        "Installed algorithms: grpo (the default), sft, dpo, ppo, distillation, rm, rft (from rlcore-rft) "
        "(rlcore algorithms list shows each with its status)." in text
    ), text
    assert second == first  # the list is not appended again
    assert not shown["torch"]
