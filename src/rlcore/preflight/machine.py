"""``rlcore doctor``'s side of the preflight: gather this machine's facts (no config) and run every check on
them: the host's, the engine imports', each installed backend's status and its own checks."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

from rlcore.distributed.ray_runtime import pid_alive
from rlcore.plugins.spec import BackendSpec
from rlcore.preflight import engines, host
from rlcore.preflight.backend_checks import backend_checks, installed_distributions
from rlcore.preflight.facts import HostFacts
from rlcore.preflight.probe import probe_imports
from rlcore.preflight.result import CheckResult

if TYPE_CHECKING:
    from rlcore.plugins import BackendRecord

#: Imported by every run (torch, ray) or by the Hugging Face side of every backend.
BASE_MODULES = ("torch", "transformers", "ray")


def engine_modules(records: list[BackendRecord]) -> list[str]:
    """The base modules plus every module a discovered backend requires, in a stable order."""
    required = [m for r in records if r.spec is not None for m in r.spec.requires]
    return list(dict.fromkeys([*BASE_MODULES, *required]))


def worker_targets(records: list[BackendRecord]) -> list[str]:
    """``module:Class`` of every usable backend's worker (what a Ray worker imports)."""
    return list(
        dict.fromkeys(r.spec.worker_class for r in records if isinstance(r.spec, BackendSpec) and r.status == "ok")
    )


def import_targets(records: list[BackendRecord]) -> dict[str, str]:
    """``{module: target}``: what to import to tell a required module works, where a backend's
    ``import_check`` (``'module:Attr'``) says more than the plain import of its module does."""
    checks = [r.spec.import_check for r in records if isinstance(r.spec, BackendSpec) and r.spec.import_check]
    return {target.partition(":")[0]: target for target in checks}


def run_checks(timeout_s: float = 120.0) -> list[CheckResult]:
    """Every check, in the order they are shown. Never starts Ray or an engine."""
    from rlcore.plugins import get_registry
    from rlcore.plugins.spec import module_exists

    records = get_registry().backends()
    modules = engine_modules(records)
    installed = [m for m in modules if module_exists(m)]
    targets = import_targets(records)
    # One probe process, torch first so the rest reuse it; workers last (they import the engines).
    found = probe_imports([targets.get(m, m) for m in installed] + worker_targets(records), timeout_s)
    probes = {m: found[targets.get(m, m)] for m in installed}
    dists = installed_distributions()
    torch_probe = probes.get("torch")
    facts = HostFacts(installed=dists, probes=found, cpuinfo=host.read_cpuinfo())
    names = [r.name for r in records]
    checks: list[tuple[str, Callable[[], CheckResult | list[CheckResult]]]] = [
        ("python", lambda: host.check_python(_python_version(), _rlcore_meta("Requires-Python"))),
        ("rlcore", lambda: host.check_rlcore(_rlcore_meta("Version"), str(Path(__file__).resolve().parents[1]))),
        ("torch", lambda: engines.check_torch(torch_probe, dists.get("torch"))),
        (
            "gpu",
            lambda: engines.check_gpu(torch_probe, shutil.which("nvidia-smi"), os.environ.get("CUDA_VISIBLE_DEVICES")),
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
                    found.get(r.spec.worker_class) if isinstance(r.spec, BackendSpec) else None,
                    names.count(r.name) > 1,
                ),
            )
            for r in records
        ),
        *((f"checks:{r.name}", partial(backend_checks, r, facts)) for r in records),
        ("shm", lambda: host.check_shm("/dev/shm", *host.read_shm("/dev/shm"))),
        (
            "leftovers",
            lambda: host.check_leftovers(
                host.find_shm_segments(), host.find_mapped_shm(), host.find_rlray_dirs(), pid_alive
            ),
        ),
        ("ports", lambda: host.check_ports(host.try_bind(0), host.ports_in_use())),
    ]
    return distinct_names([line for name, check in checks for line in _guarded(name, check)])


def _guarded(name: str, check: Callable[[], CheckResult | list[CheckResult]]) -> list[CheckResult]:
    """A check's own bug (or its fact-gathering's) becomes a failed line, not a crashed doctor."""
    try:
        found = check()
    except Exception as exc:  # noqa: BLE001
        return [
            CheckResult(
                name, "fail", f"the check itself crashed: {type(exc).__name__}: {exc}", "report this as an rlcore bug"
            )
        ]
    return found if isinstance(found, list) else [found]


def distinct_names(results: list[CheckResult]) -> list[CheckResult]:
    """The lines with a name each: the core's lines keep theirs, and a backend's line named like another line is
    shown as ``<backend>:<name>`` (then ``#2``, ``#3``... if that too is taken)."""
    taken = {r.name for r in results if not r.details.get("backend")}
    out = []
    for result in results:
        name, backend = result.name, result.details.get("backend")
        if backend:
            name = f"{backend}:{name}" if name in taken else name
            base, n = name, 1
            while name in taken:
                n += 1
                name = f"{base}#{n}"
            taken.add(name)
        out.append(result if name == result.name else replace(result, name=name))
    return out


def _python_version() -> tuple[int, int, int]:
    return sys.version_info.major, sys.version_info.minor, sys.version_info.micro


def _rlcore_meta(field: str) -> str | None:
    try:
        values = metadata.metadata("rlcore").get_all(field)
    except metadata.PackageNotFoundError:
        return None
    return str(values[0]) if values else None
