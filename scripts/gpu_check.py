#!/usr/bin/env python3
"""``make gpu-check``: every CUDA path of rlcore on this machine's GPU, in one command.

On a machine whose torch sees no CUDA device this prints one line and exits 0. Otherwise, with the
Python that runs it (the machine's own, holding its CUDA torch: nothing here installs torch):

1. installs wheels from ``--wheels DIR`` (``WHEELS=DIR`` for make): Ray, megatron-core, pydantic,
   ... Halves of a wheel split to fit a transfer limit (``NAME.whl.part-aa``, ``-ab``, ...) are
   joined first. No index is contacted (``--no-index``), a wheel never replaces a newer installed
   version, and the machine's torch / triton / nvidia-* packages are never touched;
2. installs rlcore and every plugin under ``plugins/`` from this checkout
   (``pip install --no-deps --no-build-isolation --no-index -e``); if that is impossible (no
   setuptools), puts their sources and entry-point metadata on ``PYTHONPATH`` instead;
3. reports every import rlcore needs and what is missing (a missing optional piece - Ray,
   megatron-core - is named, and the tests that need it skip with that reason);
4. runs every ``gpu``-marked test (files under ``tests/`` and ``plugins/*/tests/`` that use the
   marker), with a per-test timeout when pytest-timeout is there;
5. runs ``benchmarks/gpu.py`` in the time that is left;
6. writes ``summary.json`` and ``summary.md`` (a table to paste into ``benchmarks/README.md``) and
   the logs under ``--out`` (default ``runs/gpu-check``).

The whole run is held to ``--budget-s`` (default 540 s, inside 10 minutes). Exit status: 0 when
every check ran and passed; 1 when a test or the benchmark failed; 2 when setup failed; 3 when
everything that ran passed but a piece was missing (e.g. no megatron-core wheel given).

Wheels a GPU machine without network needs (the 'cuda' image has torch, transformers,
safetensors, numpy, pytest, pluggy, typer, pyyaml, tqdm, click, requests, protobuf, msgpack,
filelock, packaging, psutil, setuptools but not these), fetched on a machine with pip::

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \\
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform linux_x86_64 -d .whl \\
        ray==2.60.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 \\
        rpds-py==2026.9.1 pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 \\
        typing-inspection==0.4.5 typing-extensions==4.16.0 megatron-core==0.16.1
    # A wheel over a transfer's size limit (Ray's, ~79 MB) can travel in halves; they are joined here:
    for w in .whl/ray-*.whl; do split -b 40M "$w" "$w.part-" && rm "$w"; done   # -> NAME.whl.part-aa, -ab

then ``make gpu-check WHEELS=.whl`` (or ``python3 scripts/gpu_check.py --wheels .whl --out DIR``).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path
from typing import Any, Iterable

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "runs" / "gpu-check"
DEFAULT_BUDGET_S = 540.0
#: Seconds kept for benchmarks/gpu.py however long the tests take (enough for the 0.5B raw + dtensor rows).
BENCH_MIN_S = 150.0
#: Distributions a wheel folder must never replace: the machine's own CUDA stack.
PROTECTED = re.compile(r"^(torch|torchvision|torchaudio|triton|nvidia-.*|cuda-.*|jax.*)$")
#: What rlcore needs to import at all, with the wheel(s) that provide it.
REQUIRED = {
    "torch": "the machine's CUDA torch (never installed here)",
    "transformers": "transformers", "safetensors": "safetensors", "tokenizers": "tokenizers",
    "numpy": "numpy", "pydantic": "pydantic + pydantic-core, annotated-types, typing-inspection, typing-extensions",
    "pluggy": "pluggy", "typer": "typer", "yaml": "pyyaml", "pytest": "pytest",
}
#: What some checks need; without it they are skipped, and the run is reported incomplete.
OPTIONAL = {
    "ray": "ray + jsonschema, jsonschema-specifications, referencing, rpds-py: every Policy test and the benchmark",
    "megatron.core": "megatron-core: the megatron tests and benchmark rows",
    "pytest_timeout": "pytest-timeout: a hung test fails alone instead of stopping the run at the budget",
}
PLUGIN_MODULES = {"rlcore": "rlcore", "rl-dtensor": "rl_dtensor", "rl-fsdp1": "rl_fsdp1",
                  "rl-megatron": "rl_megatron", "rl-vllm": "rl_vllm"}
GPU_MARK = re.compile(r"pytest\.mark\.gpu\b")
RECORD_ENV = "RLCORE_GPU_RECORD"  # tests/support_gpu.py appends measured values here


def log(message: str) -> None:
    print(f"gpu-check: {message}", flush=True)


# --------------------------------------------------------------------------- CUDA


_PROBE = r"""
import json, platform
out = {"python": platform.python_version(), "executable": __import__("sys").executable}
try:
    import torch
except Exception as exc:
    out["error"] = f"torch is not importable: {type(exc).__name__}: {exc}"
else:
    out.update(torch=torch.__version__, cuda_build=torch.version.cuda, cuda=torch.cuda.is_available())
    if out["cuda"]:
        try:
            props = torch.cuda.get_device_properties(0)
            out.update(count=torch.cuda.device_count(), name=props.name,
                       memory_gb=round(props.total_memory / 2**30, 1), capability=f"{props.major}.{props.minor}")
            out["bf16"] = torch.cuda.is_bf16_supported()
            version = torch.cuda.nccl.version()
            out["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        except Exception as exc:
            out["probe_problem"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""


def probe_cuda(python: str) -> dict[str, Any]:
    """What torch sees, from a fresh process (this one never creates a CUDA context)."""
    try:
        proc = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=180)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"error": f"could not run {python}: {exc}"}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"probing torch failed (exit {proc.returncode}): {tail}"}
    return json.loads(lines[-1])


def no_cuda_line(info: dict[str, Any]) -> str | None:
    """The one line printed on a machine without CUDA, or None when there is a GPU to check."""
    if "error" in info:
        return f"gpu-check: no CUDA here ({info['error']}): nothing to check"
    if not info.get("cuda"):
        build = f"CUDA {info['cuda_build']} build" if info.get("cuda_build") else "CPU-only build"
        return f"gpu-check: no CUDA device visible to torch {info.get('torch')} ({build}): nothing to check"
    return None


# --------------------------------------------------------------------------- wheels


def _natural(text: str) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def wheel_name(path: Path) -> tuple[str, str]:
    """(normalised distribution name, version) from a wheel's file name."""
    parts = path.name[:-len(".whl")].split("-")
    if len(parts) < 5:
        raise ValueError(f"{path.name} is not a wheel file name")
    return re.sub(r"[-_.]+", "-", parts[0]).lower(), parts[1]


def _version_key(version: str) -> Any:
    try:
        from packaging.version import Version

        return Version(version)
    except Exception:  # noqa: BLE001 - no packaging, or an odd version string
        return _natural(version)


def collect_wheels(folders: Iterable[Path], work: Path) -> tuple[list[Path], list[str]]:
    """Wheels under ``folders`` (recursively), split wheels joined into ``work``; returns (wheels, notes).

    ``NAME.whl.part-*`` files are concatenated in natural order into ``work/NAME.whl`` and kept
    only if the result is a valid zip (a missing half is reported, not installed). Protected
    distributions are left out; of two versions of one distribution the newer is kept.
    """
    notes: list[str] = []
    found: list[Path] = []
    parts: dict[str, list[Path]] = {}
    for folder in folders:
        if not folder.is_dir():
            notes.append(f"wheel folder {folder} does not exist")
            continue
        for path in folder.rglob("*"):
            if path.is_file() and path.name.endswith(".whl"):
                found.append(path)
            elif path.is_file() and ".whl.part" in path.name:
                parts.setdefault(path.name[:path.name.index(".whl.part") + 4], []).append(path)
    for name, pieces in sorted(parts.items()):
        if any(p.name == name for p in found):
            continue  # the whole wheel is there too
        pieces.sort(key=lambda p: _natural(p.name))
        work.mkdir(parents=True, exist_ok=True)
        joined = work / name
        with open(joined, "wb") as out:
            for piece in pieces:
                with open(piece, "rb") as src:
                    shutil.copyfileobj(src, out, 16 << 20)
        try:
            with zipfile.ZipFile(joined) as archive:
                bad = archive.testzip()
            if bad is not None:
                raise zipfile.BadZipFile(f"bad CRC in {bad}")
        except (zipfile.BadZipFile, OSError) as exc:
            joined.unlink(missing_ok=True)
            notes.append(f"{name}: joining {len(pieces)} part(s) ({', '.join(p.name for p in pieces)}) does not give "
                         f"a valid wheel ({exc}); a part is missing or damaged")
            continue
        notes.append(f"{name}: joined from {len(pieces)} parts")
        found.append(joined)
    newest: dict[str, Path] = {}
    for path in sorted(found, key=lambda p: p.name):
        try:
            dist, version = wheel_name(path)
        except ValueError as exc:
            notes.append(str(exc))
            continue
        if PROTECTED.match(dist):
            notes.append(f"{path.name}: left out (the machine's own {dist} is used)")
            continue
        if dist in newest:
            other = newest[dist]
            keep, drop = sorted([other, path], key=lambda p: _version_key(wheel_name(p)[1]))[::-1]
            notes.append(f"{drop.name}: left out ({keep.name} is newer)")
            newest[dist] = keep
        else:
            newest[dist] = path
    return sorted(newest.values(), key=lambda p: p.name), notes


def installed_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def wheels_to_install(wheels: list[Path], installed: Any = installed_version) -> tuple[list[Path], list[str]]:
    """The wheels that add or upgrade a distribution (an installed newer or equal version is kept)."""
    chosen, notes = [], []
    for path in wheels:
        dist, version = wheel_name(path)
        have = installed(dist)
        if have is not None and _version_key(have) >= _version_key(version):
            notes.append(f"{dist}: {have} already installed (wheel {version} not needed)")
            continue
        chosen.append(path)
    return chosen, notes


def run_logged(cmd: list[str], logfile: Path, timeout_s: float, env: dict | None = None) -> int:
    with open(logfile, "a", encoding="utf-8") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        try:
            return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=max(5.0, timeout_s), env=env,
                                  cwd=ROOT).returncode
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
    return (f"pip could not install the checkout (see install.log); sources and entry points put on "
            f"PYTHONPATH from {shim}", {"PYTHONPATH": os.pathsep.join(paths)})


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

VERSION_DISTS = ("torch", "transformers", "safetensors", "numpy", "pydantic", "pluggy", "typer", "pyyaml", "ray",
                 "megatron-core", "pytest", "pytest-timeout", "rlcore", "rl-dtensor", "rl-fsdp1", "rl-megatron",
                 "rl-vllm")


def check_imports(python: str, env: dict[str, str]) -> dict[str, Any]:
    modules = [*REQUIRED, *OPTIONAL, *PLUGIN_MODULES.values()]
    proc = subprocess.run([python, "-c", _IMPORTS, ",".join(modules), ",".join(VERSION_DISTS)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1]}
    return json.loads(lines[-1])


# --------------------------------------------------------------------------- tests


def gpu_test_files(root: Path = ROOT) -> list[Path]:
    """Test files that use the ``gpu`` marker, under ``tests/`` and ``plugins/*/tests/``."""
    candidates = [*sorted((root / "tests").glob("test_*.py")), *sorted(root.glob("plugins/*/tests/test_*.py"))]
    return [p for p in candidates if GPU_MARK.search(p.read_text(encoding="utf-8", errors="replace"))]


def run_streaming(cmd: list[str], logfile: Path, timeout_s: float, env: dict[str, str]) -> tuple[int, bool]:
    """Run ``cmd`` in its own process group, copying its output to ``logfile`` and to stdout as it comes.

    Past ``timeout_s`` the group gets SIGINT (pytest then still writes its report), and SIGKILL 20 s
    later. Returns (exit code, timed out).
    """
    import selectors

    with open(logfile, "wb") as f:
        f.write(f"$ {' '.join(cmd)}\n".encode())
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                start_new_session=True)
        fd = proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        timed_out = killed = False
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while True:
                now = time.monotonic()
                if not timed_out and now > deadline:
                    timed_out = True
                    f.write(f"\n(gpu-check: time budget of {timeout_s:.0f}s reached: interrupting)\n".encode())
                    _signal_group(proc, signal.SIGINT)
                    deadline = now + 20
                elif timed_out and not killed and now > deadline:
                    killed = True
                    _signal_group(proc, signal.SIGKILL)
                if not sel.select(timeout=1.0):
                    continue
                chunk = os.read(fd, 65536)  # never waits for a whole line: a hung test cannot block the timeout
                if not chunk:
                    break
                f.write(chunk)
                f.flush()
                sys.stdout.write(chunk.decode("utf-8", errors="replace"))
                sys.stdout.flush()
        proc.stdout.close()
        return proc.wait(), timed_out


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def parse_junit(path: Path) -> dict[str, Any]:
    """Counts and one row per test case of a pytest ``--junitxml`` report."""
    if not path.exists():
        return {"error": f"no report at {path}", "cases": [], "counts": {}}
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    cases = []
    for suite in suites:
        for case in suite.iter("testcase"):
            outcome, message = "passed", ""
            for child in case:
                if child.tag in ("failure", "error", "skipped"):
                    outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                    message = (child.get("message") or (child.text or "")).strip()
                    break
            classname, name = case.get("classname", ""), case.get("name", "")
            cases.append({"id": _test_id(classname, name, case.get("file")), "outcome": outcome,
                          "seconds": round(float(case.get("time") or 0.0), 2), "message": _one_line(message)})
    counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "error", "skipped")}
    return {"cases": cases, "counts": counts,
            "seconds": round(sum(float(s.get("time") or 0.0) for s in suites), 1)}


def _test_id(classname: str, name: str, file: str | None) -> str:
    """``path/to/test_file.py::name`` from junit's dotted classname (``tests.test_x`` / ``test_x.Class``)."""
    if file:
        return f"{file}::{name}"
    parts = classname.split(".")
    for split in range(len(parts), 0, -1):
        candidate = "/".join(parts[:split]) + ".py"
        matches = [candidate] if (ROOT / candidate).exists() else \
            [str(p.relative_to(ROOT)) for p in ROOT.glob(f"plugins/*/tests/{candidate}")]
        if matches:
            return "::".join([matches[0], *parts[split:], name])
    return f"{classname}::{name}" if classname else name


def _one_line(text: str, limit: int = 240) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def last_json(text: str) -> dict[str, Any] | None:
    """The benchmark's result: the last line that is a JSON object (Ray may log after it)."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(value, dict) and ("presets" in value or "skipped" in value):
                return value
    return None


def read_records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def leak_lines(log_text: str) -> list[str]:
    """What the suite's leak check reported (conftest.py), if anything."""
    lines = log_text.splitlines()
    for i, line in enumerate(lines):
        if "leak check: the test session left these behind" in line:
            return [ln.strip() for ln in lines[i + 1:] if ln.startswith("  ")][:20]
    return []


# --------------------------------------------------------------------------- summary


def summarize(env_info: dict, setup: dict, tests: dict, records: list[dict], bench: dict | None,
              timings: dict[str, float], notes: list[str]) -> dict[str, Any]:
    counts = tests.get("counts", {})
    failed = counts.get("failed", 0) + counts.get("error", 0)
    missing = [m for m, info in setup.get("imports", {}).items() if m in OPTIONAL and not info.get("ok")]
    bench_ok = bench is not None and "error" not in bench and not _bench_errors(bench)
    if setup.get("problems") and not counts:
        status = "setup failed"
    elif failed or tests.get("error") or tests.get("timed_out") or tests.get("leaks") \
            or (bench is not None and not bench_ok):
        status = "failed"
    elif missing or bench is None:
        status = "incomplete"
    else:
        status = "passed"
    return {"status": status, "machine": env_info, "setup": setup, "tests": tests, "records": records,
            "benchmark": bench, "seconds": timings, "missing": missing, "notes": notes,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def _bench_errors(bench: dict) -> list[str]:
    out = []
    for preset, entry in (bench.get("presets") or {}).items():
        if "error" in entry:
            out.append(f"{preset}: {entry['error']}")
        for side, row in entry.items():
            if isinstance(row, dict) and "error" in row:
                out.append(f"{preset} {side}: {row['error']}")
    return out


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, dict):
        return ", ".join(f"{k} {_fmt(v)}" for k, v in value.items())
    return str(value)


def render_markdown(summary: dict[str, Any]) -> str:
    m = summary.get("machine", {})
    tests = summary.get("tests", {})
    counts = tests.get("counts", {})
    lines = [f"### `make gpu-check`, {summary.get('date')}: **{summary['status']}**", "",
             f"{m.get('name', '?')} ({m.get('memory_gb', '?')} GiB, sm {m.get('capability', '?')}, "
             f"{m.get('count', '?')} GPU), torch {m.get('torch', '?')} (CUDA {m.get('cuda_build', '?')}, "
             f"NCCL {m.get('nccl', '?')}), Python {m.get('python', '?')}.", ""]
    secs = summary.get("seconds", {})
    lines += ["| step | result | s |", "| --- | --- | --- |"]
    setup = summary.get("setup", {})
    lines.append(f"| install | {setup.get('checkout', '-')}; {len(setup.get('wheels_installed', []))} wheel(s)"
                 f"{'; problems: ' + '; '.join(setup['problems']) if setup.get('problems') else ''} | "
                 f"{secs.get('install', 0):.0f} |")
    if summary.get("missing"):
        lines.append(f"| missing | {', '.join(summary['missing'])} (their checks are skipped) | |")
    lines.append(f"| tests | {counts.get('passed', 0)} passed, {counts.get('failed', 0)} failed, "
                 f"{counts.get('error', 0)} errors, {counts.get('skipped', 0)} skipped"
                 f"{' (timed out)' if tests.get('timed_out') else ''}{'; ' + tests['error'] if tests.get('error') else ''}"
                 f" | {secs.get('tests', 0):.0f} |")
    if tests.get("leaks"):
        lines.append(f"| leak check | {'; '.join(tests['leaks'][:5])} | |")
    bench = summary.get("benchmark")
    bench_state = "not run" if bench is None else ("error: " + bench["error"] if "error" in bench else "ran")
    lines.append(f"| benchmarks/gpu.py | {bench_state} | {secs.get('benchmark', 0):.0f} |")
    lines.append(f"| total | | {secs.get('total', 0):.0f} |")

    records: dict[str, list[str]] = {}
    for r in summary.get("records", []):
        extra = {k: v for k, v in r.items() if k not in ("test", "name", "value", "tolerance")}
        tol = f" (tol {_fmt(r['tolerance'])})" if "tolerance" in r else ""
        records.setdefault(r.get("test", ""), []).append(f"{r['name']} {_fmt(r['value'])}{tol}"
                                                          + (f" [{_fmt(extra)}]" if extra else ""))
    lines += ["", "| test | outcome | s | measured / reason |", "| --- | --- | --- | --- |"]
    for case in tests.get("cases", []):
        measured = "; ".join(records.get(case["id"], [])) or case.get("message", "")
        if case["outcome"] in ("failed", "error") and case.get("message"):
            measured = case["message"] + ("; " + measured if measured != case["message"] else "")
        lines.append(f"| `{case['id']}` | {case['outcome']} | {case['seconds']:.1f} | {measured.replace('|', '/')} |")

    if bench and "presets" in bench:
        lines += ["", f"Benchmark (`benchmarks/gpu.py`), dense bf16 peak {bench.get('peak_bf16_tflops')} TFLOP/s:", "",
                  "| preset | S x batch | side | step s | TFLOP/s | MFU | vs raw | peak GB | theory GB |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        refits = []
        for preset, entry in bench["presets"].items():
            shape = f"{entry.get('seq', '?')} x {entry.get('batch', '?')}"
            for side in ("raw", "dtensor", "megatron"):
                row = entry.get(side)
                if not isinstance(row, dict):
                    continue
                if "step_s" not in row:
                    lines.append(f"| {preset} | {shape} | {side} | {row.get('error') or row.get('skipped')} | | | | | |")
                    continue
                lines.append(f"| {preset} | {shape} | {side} | {row['step_s']:.3f} | {row['tflops']} | "
                             f"{row.get('mfu') if row.get('mfu') is not None else '-'} | {row.get('vs_raw', '-')} | "
                             f"{row['peak_gb']} | {row.get('theory_gb', '-')} |")
                if row.get("refit"):
                    refits.append((preset, side, row["refit"]))
            if "error" in entry or "skipped" in entry:
                lines.append(f"| {preset} | | | {entry.get('error') or entry.get('skipped')} | | | | | |")
        if refits:
            lines += ["", "| preset | refit from | GB | refit s | GB/s | device copy GB/s | refit / copy |",
                      "| --- | --- | --- | --- | --- | --- | --- |"]
            for preset, side, r in refits:
                lines.append(f"| {preset} | {side} | {r['bytes'] / 1e9:.2f} | {r['refit_s']} | {r['refit_gb_s']} | "
                             f"{r['d2d_gb_s']} | {r['refit_vs_d2d']}x |")
    if summary.get("notes"):
        lines += ["", *(f"- {n}" for n in summary["notes"])]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Check every CUDA path of rlcore on this machine's GPU.")
    parser.add_argument("--wheels", action="append", default=[],
                        help="folder of wheels to install first (repeatable; also $WHEELS)")
    parser.add_argument("--out", default=None, help=f"where the summary and logs go (default {DEFAULT_OUT})")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="the whole run's time limit")
    parser.add_argument("--python", default=sys.executable, help="the Python with the machine's CUDA torch")
    parser.add_argument("--no-install", action="store_true", help="use what is installed as it is")
    parser.add_argument("--no-benchmark", action="store_true")
    parser.add_argument("--pytest-args", default="", help="extra pytest arguments (e.g. \"-k dtensor\")")
    args = parser.parse_args(argv)
    start = time.monotonic()
    deadline = start + args.budget_s

    def left() -> float:
        return deadline - time.monotonic()

    info = probe_cuda(args.python)
    line = no_cuda_line(info)
    if line is not None:
        print(line)
        return 0

    out = Path(args.out) if args.out else DEFAULT_OUT
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("summary.json", "summary.md", "install.log", "pytest.log", "junit.xml", "records.jsonl",
                  "benchmark.log"):
        (out / stale).unlink(missing_ok=True)
    log(f"{info.get('name')} x{info.get('count')}, torch {info.get('torch')} (CUDA {info.get('cuda_build')}), "
        f"Python {info.get('python')}; output in {out}")
    timings: dict[str, float] = {}
    notes: list[str] = []
    setup: dict[str, Any] = {"problems": [], "wheels_installed": []}
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}

    # 1-2. install
    t0 = time.monotonic()
    install_log = out / "install.log"
    install_log.write_text("")
    folders = [Path(w) for w in [*args.wheels, *filter(None, [os.environ.get("WHEELS")])]]
    if not args.no_install:
        if folders:
            wheels, wheel_notes = collect_wheels(folders, ROOT / "runs" / "gpu-check-wheels")  # not in --out
            # What is installed can only be read here for the Python running this script.
            todo, kept = wheels_to_install(wheels) if Path(args.python) == Path(sys.executable) else (wheels, [])
            notes += wheel_notes
            setup["wheels_kept"] = kept
            problems = install_wheels(args.python, todo, install_log, min(180.0, left()))
            setup["problems"] += problems
            setup["wheels_installed"] = [w.name for w in todo if not any(w.name in p for p in problems)]
            log(f"wheels: {len(setup['wheels_installed'])} installed, {len(kept)} already there"
                + (f", problems: {problems}" if problems else ""))
        how, extra_env = install_checkout(args.python, install_log, min(180.0, left()))
        setup["checkout"] = how
        env.update({k: os.pathsep.join(filter(None, [v, env.get(k)])) for k, v in extra_env.items()})
        log(f"checkout: {how}")
    else:
        setup["checkout"] = "not installed (--no-install)"
    found = check_imports(args.python, env)
    setup.update(found)
    timings["install"] = round(time.monotonic() - t0, 1)
    for module, state in found.get("imports", {}).items():
        if not state.get("ok"):
            where = REQUIRED.get(module) or OPTIONAL.get(module) or f"{module} (this checkout)"
            kind = "optional" if module in OPTIONAL else "REQUIRED"
            log(f"missing {kind} import {module}: {state.get('error')} -> provide: {where}")
            if module not in OPTIONAL:
                setup["problems"].append(f"cannot import {module}: {state.get('error')}")
    for backend in found.get("backends", []):
        log(f"backend {backend.get('name')}: {backend.get('status')}"
            + (f" ({backend.get('problem')})" if backend.get("problem") else ""))

    # 4. tests
    t0 = time.monotonic()
    tests: dict[str, Any] = {"cases": [], "counts": {}}
    files = gpu_test_files()
    records_path = out / "records.jsonl"
    if "error" in found or any(not found.get("imports", {}).get(m, {}).get("ok") for m in ("torch", "pytest")):
        tests["error"] = "not run: torch or pytest cannot be imported"
    else:
        # The tests take what they need; the benchmark gets the rest, at least BENCH_MIN_S.
        budget = max(60.0, left() - (0.0 if args.no_benchmark else BENCH_MIN_S) - 15.0)
        cmd = [args.python, "-m", "pytest", "-m", "gpu", "-v", "-rfEs", "-p", "no:cacheprovider",
               f"--junitxml={out / 'junit.xml'}", "-o", "junit_family=xunit1"]
        if found.get("imports", {}).get("pytest_timeout", {}).get("ok"):
            cmd += ["--timeout", str(int(min(180.0, budget)))]
        cmd += [*shlex.split(args.pytest_args), *(str(f.relative_to(ROOT)) for f in files)]
        log(f"pytest: {len(files)} files with gpu tests, {budget:.0f}s budget")
        code, timed_out = run_streaming(cmd, out / "pytest.log", budget, {**env, RECORD_ENV: str(records_path)})
        tests = parse_junit(out / "junit.xml")
        tests.update(exit_code=code, timed_out=timed_out, files=[str(f.relative_to(ROOT)) for f in files],
                     leaks=leak_lines((out / "pytest.log").read_text(encoding="utf-8", errors="replace")))
        if code not in (0, 1) and not timed_out:  # 2 interrupted, 3 internal error, 4 usage error, 5 no tests
            tests["error"] = f"pytest exited {code} (see pytest.log)"
        elif not sum(tests.get("counts", {}).values()):
            tests["error"] = "no test ran (see pytest.log)"
    timings["tests"] = round(time.monotonic() - t0, 1)

    # 5. benchmark
    bench = None
    t0 = time.monotonic()
    if not args.no_benchmark and not tests.get("error"):
        budget = left() - 20.0
        if budget < 60:
            notes.append(f"benchmark not run: {max(budget, 0):.0f}s of the budget left")
        else:
            cmd = [args.python, str(ROOT / "benchmarks" / "gpu.py"), "--budget-s", str(int(budget - 20))]
            log(f"benchmark: {budget:.0f}s budget")
            code, timed_out = run_streaming(cmd, out / "benchmark.log", budget, env)
            bench = last_json((out / "benchmark.log").read_text(errors="replace"))  # partial if interrupted
            if bench is None or code != 0:
                bench = {"error": f"exit {code}{' (timed out)' if timed_out else ''}; see benchmark.log",
                         **(bench or {})}
    timings["benchmark"] = round(time.monotonic() - t0, 1)
    timings["total"] = round(time.monotonic() - start, 1)

    # 6. summary
    summary = summarize(info, setup, tests, read_records(records_path), bench, timings, notes)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    markdown = render_markdown(summary)
    (out / "summary.md").write_text(markdown)
    print(markdown)
    log(f"{summary['status']} in {timings['total']:.0f}s; {out / 'summary.md'} and summary.json written")
    return {"passed": 0, "failed": 1, "setup failed": 2, "incomplete": 3}[summary["status"]]


if __name__ == "__main__":
    sys.exit(main())
