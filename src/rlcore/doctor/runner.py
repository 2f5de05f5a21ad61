"""Gather the machine's facts and run every doctor check on them."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable
from functools import partial
from importlib import metadata
from pathlib import Path
from typing import Any

from rlcore.distributed.ray_runtime import pid_alive
from rlcore.doctor import engines, host
from rlcore.doctor.probe import probe_imports
from rlcore.doctor.result import CheckResult

#: Imported by every run (torch, ray) or by the Hugging Face side of every backend.
BASE_MODULES = ("torch", "transformers", "ray")
#: What a worker takes from an engine package whose own import is lazy: ``import vllm``
#: works even where ``from vllm import LLM`` dies (a CUDA torchvision beside a CPU torch).
ENGINE_TARGETS = {"vllm": "vllm:LLM"}


def engine_modules(records: list[Any]) -> list[str]:
    """The base modules plus every module a discovered backend requires, in a stable order."""
    required = [m for r in records if r.spec is not None for m in r.spec.requires]
    return list(dict.fromkeys([*BASE_MODULES, *required]))


def worker_targets(records: list[Any]) -> list[str]:
    """``module:Class`` of every usable backend's worker (what a Ray worker imports)."""
    return list(dict.fromkeys(r.spec.worker_class for r in records if r.spec is not None and r.status == "ok"))


def installed_distributions() -> dict[str, str]:
    """``{normalized name: version}`` of every installed distribution (metadata only)."""
    found: dict[str, str] = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            found.setdefault(name.lower().replace("_", "-").replace(".", "-"), dist.version)
    return found


def run_checks(timeout_s: float = 120.0) -> list[CheckResult]:
    """Every check, in the order they are shown. Never starts Ray or an engine."""
    from rlcore.plugins import get_registry
    from rlcore.plugins.spec import module_exists

    records = get_registry().backends()
    modules = engine_modules(records)
    installed = [m for m in modules if module_exists(m)]
    # One probe process, torch first so the rest reuse it; workers last (they import the engines).
    found = probe_imports([ENGINE_TARGETS.get(m, m) for m in installed] + worker_targets(records), timeout_s)
    probes = {m: found[ENGINE_TARGETS.get(m, m)] for m in installed}
    dists = installed_distributions()
    torch_probe = probes.get("torch")
    gpus = len(torch_probe.info.get("device_names") or []) if torch_probe is not None and torch_probe.ok else 0
    names = [r.name for r in records]
    checks: list[tuple[str, Callable[[], CheckResult]]] = [
        ("python", lambda: host.check_python(tuple(sys.version_info[:3]), _rlcore_meta("Requires-Python"))),
        ("rlcore", lambda: host.check_rlcore(_rlcore_meta("Version"), str(Path(__file__).resolve().parents[1]))),
        ("torch", lambda: engines.check_torch(torch_probe, dists.get("torch"))),
        (
            "gpu",
            lambda: engines.check_gpu(torch_probe, shutil.which("nvidia-smi"), os.environ.get("CUDA_VISIBLE_DEVICES")),
        ),
        ("torch-packages", lambda: engines.check_torch_packages(dists)),
        (
            "cpu",
            lambda: host.check_cpu(
                host.read_cpuinfo(), gpus, torch_probe.info.get("amx_permission") if torch_probe else None
            ),
        ),
        ("ray", lambda: engines.check_ray(probes.get("ray"), os.environ.get("RAY_ADDRESS"))),
        *(
            (f"import:{m}", partial(engines.check_import, m, probes.get(m)))
            for m in modules
            if m not in ("torch", "ray")
        ),
        *(
            (
                f"backend:{r.name}",
                partial(
                    engines.check_backend,
                    r,
                    probes,
                    found.get(r.spec.worker_class) if r.spec is not None else None,
                    names.count(r.name) > 1,
                ),
            )
            for r in records
        ),
        ("shm", lambda: host.check_shm("/dev/shm", *host.read_shm("/dev/shm"))),
        (
            "leftovers",
            lambda: host.check_leftovers(
                host.find_shm_segments(), host.find_mapped_shm(), host.find_rlray_dirs(), pid_alive
            ),
        ),
        ("ports", lambda: host.check_ports(host.try_bind(0), host.ports_in_use())),
    ]
    return [_guarded(name, check) for name, check in checks]


def _guarded(name: str, check: Callable[[], CheckResult]) -> CheckResult:
    """A check's own bug (or its fact-gathering's) becomes a failed line, not a crashed doctor."""
    try:
        return check()
    except Exception as exc:  # noqa: BLE001
        return CheckResult(
            name, "fail", f"the check itself crashed: {type(exc).__name__}: {exc}", "report this as an rlcore bug"
        )


def _rlcore_meta(field: str) -> str | None:
    try:
        return metadata.metadata("rlcore").get(field)
    except metadata.PackageNotFoundError:
        return None
