"""Steps 1-3 of ``make gpu-check``: install the wheels and this checkout, then check every import.

Nothing here touches the machine's torch. When pip cannot install the checkout (no setuptools), its
sources and entry-point metadata go on ``PYTHONPATH`` instead (:func:`write_metadata_shim`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .common import DEFAULT_OUT, OPTIONAL, REQUIRED, ROOT, log
from .wheels import collect_wheels, wheels_to_install

PLUGIN_MODULES = {
    "rlcore": "rlcore",
    "rl-dtensor": "rl_dtensor",
    "rl-fsdp1": "rl_fsdp1",
    "rl-megatron": "rl_megatron",
    "rl-vllm": "rl_vllm",
}


def run_logged(cmd: list[str], logfile: Path, timeout_s: float, env: dict | None = None) -> int:
    with open(logfile, "a", encoding="utf-8") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        try:
            return subprocess.run(
                cmd, check=False, stdout=f, stderr=subprocess.STDOUT, timeout=max(5.0, timeout_s), env=env, cwd=ROOT
            ).returncode
        except subprocess.TimeoutExpired:
            f.write(f"(timed out after {timeout_s:.0f}s)\n")
            return 124


def pip_install(python: str, args: list[str], logfile: Path, timeout_s: float) -> int:
    cmd = [python, "-m", "pip", "install", "--disable-pip-version-check", "--no-input", *args]
    code = run_logged(cmd, logfile, timeout_s)
    if code != 0 and "externally-managed-environment" in logfile.read_text(errors="replace")[-5000:]:
        code = run_logged(cmd + ["--break-system-packages"], logfile, timeout_s)
    return code


def install_wheels(python: str, wheels: list[Path], logfile: Path, timeout_s: float) -> list[str]:
    """Install the wheels (no index, no dependency resolution); returns problems."""
    if not wheels:
        return []
    base = ["--no-index", "--no-deps", "--no-compile"]
    if pip_install(python, base + [str(w) for w in wheels], logfile, timeout_s) == 0:
        return []
    problems = []  # one at a time, to name the ones that do not install here
    for wheel in wheels:
        if pip_install(python, base + [str(wheel)], logfile, timeout_s) != 0:
            problems.append(f"{wheel.name} did not install (wrong Python/platform tag? see install.log)")
    return problems


def plugin_dirs() -> list[Path]:
    return sorted(p.parent for p in (ROOT / "plugins").glob("*/pyproject.toml"))


def install_checkout(python: str, logfile: Path, timeout_s: float) -> tuple[str, dict[str, str]]:
    """rlcore + plugins from this checkout; returns (how, extra environment for the test processes)."""
    projects = [ROOT, *plugin_dirs()]
    args = ["--no-deps", "--no-build-isolation", "--no-index"]
    for project in projects:
        args += ["-e", str(project)]
    if pip_install(python, args, logfile, timeout_s) == 0:
        return "pip install --no-deps --no-build-isolation -e (editable)", {}
    shim = DEFAULT_OUT.parent / "gpu-check-site"
    write_metadata_shim(shim, projects)
    paths = [str(shim), str(ROOT / "src"), *(str(p / "src") for p in projects[1:])]
    how = (
        f"pip could not install the checkout (see install.log); sources and entry points put on PYTHONPATH from {shim}"
    )
    return how, {"PYTHONPATH": os.pathsep.join(paths)}


def install_all(
    python: str, folders: list[Path], logfile: Path, left: Callable[[], float], setup: dict[str, Any], notes: list[str]
) -> dict[str, str]:
    """The wheels in ``folders``, then the checkout, each within ``left()`` seconds (180 at most).

    Records what happened in ``setup`` and ``notes``; returns the environment the test processes
    need on top of this one's (``PYTHONPATH`` when the checkout could not be installed).
    """
    if folders:
        wheels, wheel_notes = collect_wheels(folders, ROOT / "runs" / "gpu-check-wheels")  # not in --out
        # What is installed can only be read here for the Python running this script.
        todo, kept = wheels_to_install(wheels) if Path(python) == Path(sys.executable) else (wheels, [])
        notes += wheel_notes
        setup["wheels_kept"] = kept
        problems = install_wheels(python, todo, logfile, min(180.0, left()))
        setup["problems"] += problems
        setup["wheels_installed"] = [w.name for w in todo if not any(w.name in p for p in problems)]
        log(
            f"wheels: {len(setup['wheels_installed'])} installed, {len(kept)} already there"
            + (f", problems: {problems}" if problems else "")
        )
    how, extra_env = install_checkout(python, logfile, min(180.0, left()))
    setup["checkout"] = how
    log(f"checkout: {how}")
    return extra_env


def write_metadata_shim(target: Path, projects: list[Path]) -> None:
    """``*.dist-info`` folders (name, version, entry points) that make the checkout's plugins discoverable
    through ``importlib.metadata`` from a ``PYTHONPATH`` entry, as an editable install would."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python < 3.11
        import tomli as tomllib  # type: ignore[no-redef]

    shutil.rmtree(target, ignore_errors=True)
    for project in projects:
        meta = tomllib.loads((project / "pyproject.toml").read_text())["project"]
        name, version = meta["name"], meta.get("version", "0")
        info = target / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        groups = dict(meta.get("entry-points", {}))
        if meta.get("scripts"):
            groups["console_scripts"] = meta["scripts"]
        lines = []
        for group, entries in groups.items():
            lines.append(f"[{group}]")
            lines += [f"{key} = {value}" for key, value in entries.items()]
            lines.append("")
        (info / "entry_points.txt").write_text("\n".join(lines))


_IMPORTS = r"""
import importlib, importlib.metadata, json, sys
out = {}
for module in sys.argv[1].split(","):
    try:
        importlib.import_module(module)
        out[module] = {"ok": True}
    except Exception as exc:
        out[module] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
versions = {}
for dist in sys.argv[2].split(","):
    try:
        versions[dist] = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        versions[dist] = None
backends = []
try:
    from rlcore.plugins import get_registry
    backends = [{k: r.as_dict()[k] for k in ("name", "kind", "status", "problem")} for r in get_registry().records]
except Exception as exc:
    backends = [{"name": "?", "status": "error", "problem": f"{type(exc).__name__}: {exc}"[:300]}]
print(json.dumps({"imports": out, "versions": versions, "backends": backends}))
"""

VERSION_DISTS = (
    "torch",
    "transformers",
    "safetensors",
    "numpy",
    "pydantic",
    "pluggy",
    "typer",
    "pyyaml",
    "ray",
    "megatron-core",
    "pytest",
    "pytest-timeout",
    "rlcore",
    "rl-dtensor",
    "rl-fsdp1",
    "rl-megatron",
    "rl-vllm",
)


def check_imports(python: str, env: dict[str, str]) -> dict[str, Any]:
    modules = [*REQUIRED, *OPTIONAL, *PLUGIN_MODULES.values()]
    proc = subprocess.run(
        [python, "-c", _IMPORTS, ",".join(modules), ",".join(VERSION_DISTS)],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1]}
    return json.loads(lines[-1])


def log_imports(found: dict[str, Any], setup: dict[str, Any]) -> None:
    """Names each missing import with what provides it (a missing required one is a setup problem),
    and each backend's state."""
    for module, state in found.get("imports", {}).items():
        if not state.get("ok"):
            where = REQUIRED.get(module) or OPTIONAL.get(module) or f"{module} (this checkout)"
            kind = "optional" if module in OPTIONAL else "REQUIRED"
            log(f"missing {kind} import {module}: {state.get('error')} -> provide: {where}")
            if module not in OPTIONAL:
                setup["problems"].append(f"cannot import {module}: {state.get('error')}")
    for backend in found.get("backends", []):
        log(
            f"backend {backend.get('name')}: {backend.get('status')}"
            + (f" ({backend.get('problem')})" if backend.get("problem") else "")
        )
