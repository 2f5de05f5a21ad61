"""A backend's own checks (``BackendSpec.checks``): what only its engine needs of this machine.

The core knows no engine. A backend that needs something of the host (a CPU flag, packages that must not be
installed beside its engine) names a ``"module:function"`` in its spec; the function is imported only when
checks run, called with :class:`~rlcore.preflight.facts.HostFacts`, and returns
:class:`~rlcore.preflight.result.CheckResult` lines. ``rlcore doctor`` shows every installed backend's lines;
``rlcore run`` and ``rlcore config validate`` refuse a config whose backends return a failed line. A backend
without ``checks`` is not checked; a checks function that cannot be imported, raises or returns something else
is one failed line in the doctor (it says whose), and is passed over before a run (it is a bug of the check,
not of the run).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import TYPE_CHECKING

from rlcore.preflight.facts import HostFacts
from rlcore.preflight.result import CheckResult

if TYPE_CHECKING:
    from rlcore.config import ResolvedConfig
    from rlcore.plugins import BackendRecord, Registry

#: ``details["broken"]`` of the line that stands for a checks function that failed itself.
BROKEN = "broken"


def backend_checks(record: BackendRecord, facts: HostFacts) -> list[CheckResult]:
    """The lines of ``record``'s own checks on ``facts`` (each with ``details["backend"]``, the backend's name);
    empty for a backend without checks, or not ``ok``."""
    spec = record.spec
    path = getattr(spec, "checks", None)
    if spec is None or record.status != "ok" or not path:
        return []
    from rlcore.plugins import import_object

    try:
        found = list(import_object(path)(facts))
        wrong = next((r for r in found if not isinstance(r, CheckResult)), None)
        if wrong is not None:
            raise TypeError(f"it returned a {type(wrong).__name__}, not rlcore.preflight.CheckResult lines")
    except Exception as exc:  # noqa: BLE001 - a plugin's bug is one line, never a crashed doctor or run
        return [_broken_line(record, path, exc)]
    return [r if "backend" in r.details else replace(r, details={**r.details, "backend": record.name}) for r in found]


def _broken_line(record: BackendRecord, path: str, exc: BaseException) -> CheckResult:
    detail = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    why = f"{type(exc).__name__}: {detail[:200]}" if detail else type(exc).__name__
    where = f"{record.distribution} {record.version}".strip()
    return CheckResult(
        f"checks:{record.name}",
        "fail",
        f"{where}: its checks ({path}) are broken: {why}",
        f"report it to the authors of {record.distribution}; the backend itself may still work",
        {BROKEN: True, "backend": record.name, "distribution": record.distribution, "checks": path},
    )


def installed_distributions() -> dict[str, str]:
    """``{normalized name: version}`` of every installed distribution (metadata only)."""
    from importlib import metadata

    found: dict[str, str] = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            found.setdefault(name.lower().replace("_", "-").replace(".", "-"), dist.version)
    return found


def config_backend_problems(
    resolved: ResolvedConfig, installed: dict[str, str] | None = None, registry: Registry | None = None
) -> list[str]:
    """The failed lines of the checks of the backends ``resolved`` runs, as config problems:
    ``policy.generation.backend=<name>: <message>; fix: <fix>`` (the training backend's under
    ``policy.training_backend=<name>``). Found from package metadata and files only: nothing is imported but
    the checks' own (light) modules."""
    from rlcore.plugins import BackendError
    from rlcore.preflight.host import read_cpuinfo

    if registry is None:
        from rlcore.plugins import get_registry

        registry = get_registry()
    policy = resolved.config.policy
    keys = [("policy.training_backend", policy.training_backend)]
    if policy.generation is not None:
        keys.append(("policy.generation.backend", policy.generation.backend))
    facts = HostFacts(
        installed=installed_distributions() if installed is None else installed,
        config=resolved,
        cpuinfo=read_cpuinfo(),
    )
    problems: list[str] = []
    seen: set[str] = set()
    for key, name in keys:
        try:
            record = registry.find(name)
        except BackendError:
            continue  # resolve() has refused an unknown backend already
        if record.qualified_name in seen:
            continue
        seen.add(record.qualified_name)
        for result in _failed(backend_checks(record, facts)):
            fix = f"; fix: {result.fix}" if result.fix else ""
            problems.append(f"{key}={name}: {result.message}{fix}")
    return problems


def _failed(results: Iterable[CheckResult]) -> list[CheckResult]:
    return [r for r in results if r.status == "fail" and not r.details.get(BROKEN)]


__all__ = ["BROKEN", "backend_checks", "config_backend_problems", "installed_distributions"]
