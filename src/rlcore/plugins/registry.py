"""The plugin manager: discovers backends and says which ones can be used.

Entry points of the ``rlcore.plugins`` group are loaded one at a time, so one
broken plugin never hides the others (pluggy's own loader stops at the first
failure and silently drops duplicate names). Every discovered backend gets a
status:

- ``ok``: usable.
- ``unavailable``: its engine is not installed (``install_hint`` says how).
- ``broken``: the plugin module failed to import or to register.
- ``conflict``: two distributions claim the same backend name; select one as
  ``"distribution:name"``.
- ``incompatible``: it declares a plugin API version this core does not know.
- ``disabled``: excluded by ``RLCORE_PLUGINS`` / ``RLCORE_DISABLE_PLUGINS``.

Listing never fails; selecting a backend that is not ``ok`` raises
:class:`BackendError` naming the backend, the cause and the fix.
"""

from __future__ import annotations

import difflib
import os
import traceback
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Iterable

import pluggy

from rlcore.plugins import hookspecs
from rlcore.plugins.algorithm_spec import AlgorithmSpec
from rlcore.plugins.spec import BackendSpec
from rlcore.plugins.versions import SUPPORTED_PLUGIN_API_VERSIONS

ENTRY_POINT_GROUP = "rlcore.plugins"


class BackendError(RuntimeError):
    """A selected backend cannot be used; the message names the cause and the fix."""


@dataclass
class BackendRecord:
    """One row of ``rlcore backends list``."""

    name: str
    kind: str
    plugin: str
    distribution: str
    version: str
    status: str = "ok"
    problem: str = ""
    spec: BackendSpec | AlgorithmSpec | None = None

    @property
    def qualified_name(self) -> str:
        return f"{self.distribution}:{self.name}"

    def as_dict(self) -> dict[str, Any]:
        caps = sorted(c.value for c in getattr(self.spec, "capabilities", ()))
        return {
            "name": self.name,
            "kind": self.kind,
            "plugin": self.plugin,
            "distribution": self.distribution,
            "version": self.version,
            "status": self.status,
            "capabilities": caps,
            "plugin_api_version": getattr(self.spec, "plugin_api_version", None),
            "problem": self.problem,
        }


def _env_names(var: str) -> set[str] | None:
    raw = os.environ.get(var)
    if raw is None:
        return None
    return {part.strip() for part in raw.split(",") if part.strip()}


@dataclass
class Registry:
    """Backends discovered from plugins, with their statuses."""

    records: list[BackendRecord] = field(default_factory=list)
    _pm: pluggy.PluginManager = field(default_factory=lambda: _new_plugin_manager())

    # -- building -----------------------------------------------------------
    def register_plugin(self, plugin: object, name: str, distribution: str = "<local>", version: str = "") -> None:
        """Register a plugin object (a module or any object with hook impls).

        This is also how tests add a plugin without installing it.
        """
        specs: list[BackendSpec | AlgorithmSpec] = []
        try:
            self._pm.register(plugin, name=name)
            for hook in (self._pm.hook.rlcore_register_backends, self._pm.hook.rlcore_register_algorithms):
                for impl in hook.get_hookimpls():
                    if impl.plugin is plugin:
                        impl.function(register=specs.append)
        except Exception as exc:  # a plugin's own bug must not break discovery
            self._add_broken(name, distribution, version, exc)
            return
        for spec in specs:
            self._add_spec(spec, name, distribution, version)

    def load_entry_points(self, entry_points: Iterable[metadata.EntryPoint] | None = None) -> None:
        """Load ``rlcore.plugins`` entry points one by one, honouring the env filters."""
        allow = _env_names("RLCORE_PLUGINS")
        deny = _env_names("RLCORE_DISABLE_PLUGINS") or set()
        eps = entry_points if entry_points is not None else metadata.entry_points(group=ENTRY_POINT_GROUP)
        for ep in sorted(eps, key=lambda e: (e.dist.name if e.dist else "", e.name)):
            dist = ep.dist.name if ep.dist else "<unknown>"
            version = ep.dist.version if ep.dist else ""
            selected = {ep.name, dist}
            if (allow is not None and not selected & allow) or selected & deny:
                self.records.append(
                    BackendRecord(ep.name, "?", ep.name, dist, version, "disabled",
                                  "excluded by RLCORE_PLUGINS / RLCORE_DISABLE_PLUGINS")
                )
                continue
            try:
                plugin = ep.load()
            except Exception as exc:
                self._add_broken(ep.name, dist, version, exc)
                continue
            self.register_plugin(plugin, name=f"{dist}:{ep.name}", distribution=dist, version=version)

    def _add_broken(self, plugin: str, dist: str, version: str, exc: BaseException) -> None:
        self.records.append(
            BackendRecord(plugin, "?", plugin, dist, version, "broken", f"plugin failed to load: {_one_line(exc)}")
        )

    def _add_spec(self, spec: BackendSpec | AlgorithmSpec, plugin: str, dist: str, version: str) -> None:
        kind = "algorithm" if isinstance(spec, AlgorithmSpec) else spec.kind
        record = BackendRecord(spec.name, kind, plugin, dist, version, spec=spec)
        record.status, record.problem = _own_status(spec, dist)
        rivals = [r for r in self.records if r.spec is not None and r.name == spec.name and r.distribution != dist
                  and (r.kind == "algorithm") == (kind == "algorithm")]
        if rivals:
            for r in [*rivals, record]:
                others = [o.qualified_name for o in [*rivals, record] if o is not r]
                r.status = "conflict"
                r.problem = f"also provided by {', '.join(others)}; select one as '{r.qualified_name}'"
        self.records.append(record)

    # -- querying -----------------------------------------------------------
    def backends(self, kind: str | None = None) -> list[BackendRecord]:
        return [r for r in self.records if (kind is None and r.kind != "algorithm") or r.kind in (kind, "?")]

    def algorithms(self) -> list[BackendRecord]:
        """The registered algorithms (records of kind ``'algorithm'``)."""
        return [r for r in self.records if r.kind == "algorithm"]

    def resolve_algorithm(self, name: str) -> AlgorithmSpec:
        """The spec of an ``ok`` algorithm, by ``name`` or ``distribution:name``."""
        spec = self.resolve(name, kind="algorithm")
        assert isinstance(spec, AlgorithmSpec)
        return spec

    def resolve(self, name: str, kind: str | None = None) -> BackendSpec:
        """The spec of an ``ok`` backend, by ``name`` or ``distribution:name``."""
        record = self.find(name, kind)
        if kind is not None and record.kind != kind:
            raise BackendError(f"backend '{name}' is a {record.kind} backend, not a {kind} backend")
        status, problem = record.status, record.problem
        if status == "conflict" and ":" in name and record.spec is not None:
            status, problem = _own_status(record.spec, record.distribution)  # disambiguated by the user
        if status != "ok" or record.spec is None:
            raise BackendError(f"backend '{name}' is {status}: {problem}")
        return record.spec

    def find(self, name: str, kind: str | None = None) -> BackendRecord:
        """The record named ``name`` (``distribution:name``), of ``kind`` when given (an algorithm and a backend
        may share a name)."""
        dist, sep, short = name.rpartition(":")
        same_kind = [r for r in self.records if (r.kind == "algorithm") == (kind == "algorithm")]
        matches = [r for r in same_kind if r.name == short and (not sep or r.distribution == dist)]
        if not matches:
            if kind == "algorithm":
                known = sorted({r.name for r in self.algorithms() if r.spec is not None})
                raise BackendError(f"no algorithm named '{name}' (installed: {', '.join(known) or 'none'}); install "
                                   "the plugin that provides it")
            known = sorted({r.name for r in same_kind if r.spec is not None})
            close = difflib.get_close_matches(short, known, n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            installed = ", ".join(known) or "none"
            raise BackendError(
                f"no backend named '{name}' (installed: {installed}); {hint}"
                f"install the plugin that provides it, e.g. 'pip install rl-{short}'"
            )
        return matches[0]


def _one_line(exc: BaseException) -> str:
    """``exc`` in one line: a refused ``BackendSpec`` as its field problems, anything else with where it was raised."""
    from pydantic import ValidationError

    if isinstance(exc, ValidationError):
        problems = [(".".join(map(str, e["loc"])) + ": " if e["loc"] else "") + e["msg"].removeprefix("Value error, ")
                    for e in exc.errors()]
        return f"{exc.title} refused: {'; '.join(problems)}"
    where = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    at = f" (at {where[0].filename}:{where[0].lineno})" if where else ""
    message = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {message}{at}"


def _own_status(spec: BackendSpec | AlgorithmSpec, dist: str) -> tuple[str, str]:
    """Status of a spec on its own, before any name conflict is considered."""
    if isinstance(spec, AlgorithmSpec):
        if missing := spec.missing_requirements():
            hint = f": {spec.install_hint}" if spec.install_hint else ""
            return "unavailable", f"missing {', '.join(missing)}{hint}"
        return "ok", ""
    if spec.plugin_api_version not in SUPPORTED_PLUGIN_API_VERSIONS:
        served = ", ".join(map(str, sorted(SUPPORTED_PLUGIN_API_VERSIONS)))
        fix = ("upgrade rlcore" if spec.plugin_api_version > max(SUPPORTED_PLUGIN_API_VERSIONS)
               else f"install a release of {dist} written for one of those")
        return "incompatible", (f"declares plugin API version {spec.plugin_api_version}; this rlcore serves "
                                f"versions {served}: {fix}")
    if missing := spec.missing_requirements():
        hint = f": {spec.install_hint}" if spec.install_hint else ""
        return "unavailable", f"missing {', '.join(missing)}{hint}"
    if not spec.worker_module_exists():
        return "broken", f"worker module of {spec.worker_class} is not installed: reinstall {dist}"
    return "ok", ""


def _new_plugin_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager("rlcore")
    pm.add_hookspecs(hookspecs)
    return pm


_REGISTRY: Registry | None = None


def get_registry(refresh: bool = False) -> Registry:
    """The process-wide registry built from installed entry points (cached)."""
    global _REGISTRY
    if _REGISTRY is None or refresh:
        registry = Registry()
        registry.load_entry_points()
        _REGISTRY = registry
    return _REGISTRY


def set_registry(registry: Registry | None) -> None:
    """Replace the process-wide registry (``None`` rebuilds it on next use); for tests."""
    global _REGISTRY
    _REGISTRY = registry
