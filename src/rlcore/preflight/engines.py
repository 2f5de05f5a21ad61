"""Checks of what every run imports: torch (and its build), GPUs, Ray, each module a backend requires, and
each backend's registry status. What only one engine needs checked is that engine plugin's own
(``BackendSpec.checks``, :mod:`rlcore.preflight.backend_checks`).

The checks judge :class:`~rlcore.preflight.probe.ImportProbe` results and registry records passed in by the
caller, so a test can hand them fabricated ones.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from rlcore.preflight.probe import ImportProbe
from rlcore.preflight.result import CheckResult

if TYPE_CHECKING:
    from rlcore.plugins import BackendRecord

RUNTIME_HINT = "pip install 'rlcore[runtime]'"


def _traceback_hint(module: str, python: str) -> str:
    return f"{python} -c 'import {module}'  (shows the whole traceback)"


def torch_build(probe: ImportProbe | None, version: str | None) -> str | None:
    """'cpu', 'cuda' or 'rocm': from what the import saw, else from the version's local tag."""
    if probe is not None and probe.ok:
        if probe.info.get("hip"):
            return "rocm"
        return "cuda" if probe.info.get("cuda") else "cpu"
    local = (version or "").partition("+")[2]
    if local == "cpu":
        return "cpu"
    if local.startswith("rocm"):
        return "rocm"
    return "cuda" if local.startswith("cu") else None


def check_torch(probe: ImportProbe | None, version: str | None, python: str = sys.executable) -> CheckResult:
    """torch's version and build; every training backend needs it."""
    if probe is None:
        return CheckResult("torch", "fail", "torch is not installed", RUNTIME_HINT, {"version": None})
    build = torch_build(probe, version)
    details: dict[str, Any] = {
        "version": probe.version or version,
        "build": build,
        "import_s": probe.seconds,
        **{k: probe.info.get(k) for k in ("cuda", "hip", "cpu_capability")},
    }
    if not probe.ok:
        shown = f"torch {version}" if version else "torch"
        return CheckResult(
            "torch", "fail", f"{shown} does not import: {probe.error}", _traceback_hint("torch", python), details
        )
    kind = {
        "cpu": "CPU build",
        "cuda": f"CUDA {probe.info.get('cuda')} build",
        "rocm": f"ROCm {probe.info.get('hip')} build",
    }[build or "cpu"]
    capability = f", CPU capability {probe.info['cpu_capability']}" if probe.info.get("cpu_capability") else ""
    return CheckResult(
        "torch", "ok", f"torch {probe.version}, {kind}{capability}; imports in {probe.seconds:.1f} s", details=details
    )


def check_gpu(probe: ImportProbe | None, nvidia_smi: str | None, visible_devices: str | None = None) -> CheckResult:
    """GPUs torch sees; a CPU-only machine is fine (CPU backends), a GPU torch cannot see is not."""
    info = probe.info if probe is not None and probe.ok else {}
    names = list(info.get("device_names") or [])
    details = {
        "cuda_available": bool(info.get("cuda_available")),
        "count": len(names),
        "names": names,
        "nvidia_smi": nvidia_smi,
        "CUDA_VISIBLE_DEVICES": visible_devices,
    }
    if probe is None or not probe.ok:
        return CheckResult("gpu", "skip", "torch does not import: GPUs not checked", details=details)
    if names:
        kinds = ", ".join(f"{names.count(n)}x {n}" for n in dict.fromkeys(names))
        return CheckResult("gpu", "ok", f"{len(names)} GPU(s): {kinds}", details=details)
    hidden = f" (CUDA_VISIBLE_DEVICES={visible_devices!r})" if visible_devices is not None else ""
    if nvidia_smi and not info.get("cuda"):
        return CheckResult(
            "gpu",
            "warn",
            f"nvidia-smi is here but torch is a CPU build: the GPUs go unused{hidden}",
            "install a CUDA build of torch (https://pytorch.org/get-started/locally/)",
            details,
        )
    if nvidia_smi:
        return CheckResult(
            "gpu",
            "warn",
            f"CUDA build of torch sees no GPU though nvidia-smi is here{hidden}",
            "run nvidia-smi; check the driver and CUDA_VISIBLE_DEVICES",
            details,
        )
    return CheckResult("gpu", "ok", f"no GPU: CPU backends only{hidden}", details=details)


def check_ray(probe: ImportProbe | None, ray_address: str | None = None, python: str = sys.executable) -> CheckResult:
    """Ray's version (imported, never started); RAY_ADDRESS makes runs join that cluster instead."""
    details = {
        "version": probe.version if probe else None,
        "import_s": probe.seconds if probe else None,
        "RAY_ADDRESS": ray_address,
    }
    if probe is None:
        return CheckResult("ray", "fail", "ray is not installed: every run needs it", RUNTIME_HINT, details)
    if not probe.ok:
        return CheckResult(
            "ray", "fail", f"ray does not import: {probe.error}", _traceback_hint("ray", python), details
        )
    where = (
        f"; RAY_ADDRESS={ray_address}: runs join that cluster"
        if ray_address
        else "; runs start a private one on loopback"
    )
    return CheckResult("ray", "ok", f"ray {probe.version}, imports in {probe.seconds:.1f} s{where}", details=details)


def check_import(module: str, probe: ImportProbe | None, python: str = sys.executable) -> CheckResult:
    """One engine import other than torch and ray (transformers, megatron.core, what a backend requires...)."""
    name = f"import:{module}"
    target = probe.target if probe else module
    details = {
        "module": module,
        "target": target,
        "version": probe.version if probe else None,
        "import_s": probe.seconds if probe else None,
        "error": probe.error if probe else None,
    }
    if probe is None:
        return CheckResult(name, "skip", f"{module} is not installed", details=details)
    shown = f"from {module} import {target.partition(':')[2]}" if ":" in target else f"import {module}"
    if probe.ok:
        version = f" {probe.version}" if probe.version else ""
        return CheckResult(name, "ok", f"{module}{version}: {shown} works ({probe.seconds:.1f} s)", details=details)
    fix = f"{python} -c '{shown}'  (shows the whole traceback)"
    return CheckResult(name, "fail", f"{shown} fails: {probe.error}", fix, details)


def check_backend(
    record: BackendRecord,
    probes: Mapping[str, ImportProbe],
    worker: ImportProbe | None = None,
    qualify: bool = False,
    python: str = sys.executable,
) -> CheckResult:
    """A backend's registry status, whether the engine modules it requires import, and its worker class.

    ``record`` is a :class:`rlcore.plugins.BackendRecord`; ``probes`` maps
    engine modules to their probes; ``worker`` is the probe of the worker
    class; ``qualify`` names the line ``backend:<distribution>:<name>`` (when
    two distributions share a name).
    """
    spec = record.spec
    name = f"backend:{record.distribution}:{record.name}" if qualify else f"backend:{record.name}"
    requires = list(spec.requires) if spec is not None else []
    details = {
        "name": record.name,
        "kind": record.kind,
        "distribution": record.distribution,
        "version": record.version,
        "status": record.status,
        "problem": record.problem,
        "requires": requires,
        "worker_class": getattr(spec, "worker_class", None),
    }
    where = f"{record.distribution} {record.version}".strip()
    status = record.status
    if status == "disabled":
        return CheckResult(name, "skip", f"{where}: {record.problem}", details=details)
    if status == "unavailable":
        hint = spec.install_hint if spec is not None and spec.install_hint else f"pip install {record.distribution}"
        return CheckResult(name, "warn", f"{where}: {record.problem}", hint, details)
    if status == "conflict":
        return CheckResult(
            name,
            "warn",
            f"{where}: {record.problem}",
            f"select '{record.distribution}:{record.name}' in configs, or uninstall the other one",
            details,
        )
    if status == "broken":
        return CheckResult(
            name,
            "fail",
            f"{where}: {record.problem}",
            f"pip install --force-reinstall --no-deps {record.distribution}  "
            f"(or pip uninstall -y {record.distribution})",
            details,
        )
    if status != "ok":
        return CheckResult(
            name,
            "fail",
            f"{where}: {status}: {record.problem}",
            f"pip install -U rlcore {record.distribution}",
            details,
        )
    failed = [m for m in requires if m in probes and not probes[m].ok]
    if failed:
        return CheckResult(
            name,
            "fail",
            f"{where}: its engine {failed[0]} does not import: {probes[failed[0]].error}",
            f"see the import:{failed[0]} line",
            details,
        )
    if worker is not None and not worker.ok:
        module = worker.target.partition(":")[0]
        return CheckResult(
            name,
            "fail",
            f"{where}: worker {worker.target} does not import: {worker.error}",
            f"{python} -c 'import {module}'  (shows the whole traceback)",
            details,
        )
    imported = [m for m in requires if m in probes] + ([worker.target.rpartition(":")[2]] if worker else [])
    if not imported:
        return CheckResult(name, "ok", f"{where}, {record.kind}", details=details)
    listed = ", ".join(imported[:-1]) + " and " + imported[-1] if len(imported) > 1 else imported[0]
    return CheckResult(
        name, "ok", f"{where}, {record.kind}: {listed} import{'s' * (len(imported) == 1)}", details=details
    )
