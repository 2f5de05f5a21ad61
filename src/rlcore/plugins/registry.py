"""The plugin manager: discovers backends, environments and algorithms, and says which ones can be used.

Entry points of the ``rlcore.plugins`` group are loaded one at a time, so one
broken plugin never hides the others (pluggy's own loader stops at the first
failure and silently drops duplicate names). Backends, environments,
algorithms and tool-call parsers are kinds of record, each with its own names.
Every record gets a status:

- ``ok``: usable.
- ``unavailable``: its engine is not installed (``install_hint`` says how).
- ``broken``: the plugin module failed to import or to register, its worker
  module is missing, or it declares a capability its worker class has no
  method for (when the worker's source shows it without importing it). An
  environment spec with a bad field is broken on its own: the plugin's other
  specs, and those registered before a hook failed, are still listed.
- ``conflict``: two distributions claim the same name; select one as
  ``"distribution:name"``.
- ``incompatible``: its distribution requires an rlcore this is not
  (``Requires-Dist: rlcore>=X``).
- ``disabled``: excluded by ``RLCORE_PLUGINS`` / ``RLCORE_DISABLE_PLUGINS``.

Listing never fails; selecting a backend that is not ``ok`` raises
:class:`BackendError` naming the backend, the cause and the fix.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib import metadata

import pluggy

from rlcore.plugins import hookspecs
from rlcore.plugins.algorithm_spec import AlgorithmSpec
from rlcore.plugins.capabilities import CAPABILITY_METHODS
from rlcore.plugins.environment_spec import EnvironmentSpec
from rlcore.plugins.requirements import rlcore_requirement_problem
from rlcore.plugins.spec import BackendSpec
from rlcore.plugins.spec_refusals import Refusal, recording_refusals, refusal_of
from rlcore.plugins.tool_call_parser_spec import ToolCallParserSpec
from rlcore.plugins.unknown_names import unknown_name_message
from rlcore.plugins.worker_source import defined_methods

Spec = BackendSpec | EnvironmentSpec | AlgorithmSpec | ToolCallParserSpec

ENTRY_POINT_GROUP = "rlcore.plugins"


class BackendError(RuntimeError):
    """A selected backend cannot be used; the message names the cause and the fix."""


@dataclass
class BackendRecord:
    """One row of ``rlcore backends list`` (or ``environments list``); ``kind`` is ``'?'`` for a plugin that
    failed before it registered anything."""

    name: str
    kind: str
    plugin: str
    distribution: str
    version: str
    status: str = "ok"
    problem: str = ""
    spec: Spec | None = None
    #: The status and problem of the spec on its own, before any name conflict.
    own: tuple[str, str] = field(default=("ok", ""), repr=False)

    @property
    def qualified_name(self) -> str:
        return f"{self.distribution}:{self.name}"

    def as_dict(self) -> dict[str, object]:
        caps = sorted(c.value for c in getattr(self.spec, "capabilities", ()))
        return {
            "name": self.name,
            "kind": self.kind,
            "plugin": self.plugin,
            "distribution": self.distribution,
            "version": self.version,
            "status": self.status,
            "capabilities": caps,
            "plugin_api_version": getattr(self.spec, "plugin_api_version", None),  # ignored since rlcore 0.2
            "problem": self.problem,
        }


def group_of(kind: str | None) -> str:
    """The name space a kind of record lives in: ``'algorithm'``, ``'environment'``, ``'tool_call_parser'`` or
    ``'backend'``."""
    return kind if kind in ("algorithm", "environment", "tool_call_parser") else "backend"


def _env_names(var: str) -> set[str] | None:
    raw = os.environ.get(var)
    if raw is None:
        return None
    return {part.strip() for part in raw.split(",") if part.strip()}


@dataclass
class Registry:
    """Backends, environments and algorithms discovered from plugins, with their statuses."""

    records: list[BackendRecord] = field(default_factory=list)
    _pm: pluggy.PluginManager = field(default_factory=lambda: _new_plugin_manager())

    # -- building -----------------------------------------------------------
    def register_plugin(
        self,
        plugin: object,
        name: str,
        distribution: str = "<local>",
        version: str = "",
        requires: Iterable[str] | None = None,
    ) -> None:
        """Register a plugin object (a module or any object with hook impls); ``requires`` are its
        distribution's ``Requires-Dist`` lines, checked for the rlcore it needs.

        This is also how tests add a plugin without installing it.
        """
        incompatible = rlcore_requirement_problem(requires, distribution) if requires else ""
        specs: list[Spec] = []
        hooks = self._pm.hook
        failure: Exception | None = None
        with recording_refusals() as refusals:  # a refused environment spec is kept, so its siblings register
            try:
                self._pm.register(plugin, name=name)
                for hook in (
                    hooks.rlcore_register_backends,
                    hooks.rlcore_register_environments,
                    hooks.rlcore_register_algorithms,
                    hooks.rlcore_register_tool_call_parsers,
                ):
                    for impl in hook.get_hookimpls():
                        if impl.plugin is plugin:  # an implementation gets the arguments it declares (pluggy's rule)
                            impl.function(**{k: v for k, v in {"register": specs.append}.items() if k in impl.argnames})
            except Exception as exc:  # a plugin's own bug must not break discovery
                failure = exc
        for spec in specs:  # those registered before a failure too: one bad spec must not hide the others
            if (refused := refusal_of(spec, refusals)) is not None:
                self._add_refused(refused, name, distribution, version)
            else:
                self._add_spec(spec, name, distribution, version, incompatible)
        if failure is not None:
            self._add_broken(name, distribution, version, failure, incompatible)

    def load_entry_points(self, entry_points: Iterable[metadata.EntryPoint] | None = None) -> None:
        """Load ``rlcore.plugins`` entry points one by one, honouring the env filters."""
        allow = _env_names("RLCORE_PLUGINS")
        deny = _env_names("RLCORE_DISABLE_PLUGINS") or set()
        eps = entry_points if entry_points is not None else metadata.entry_points(group=ENTRY_POINT_GROUP)
        for ep in sorted(eps, key=lambda e: (e.dist.name if e.dist else "", e.name)):
            dist = ep.dist.name if ep.dist else "<unknown>"
            version = ep.dist.version if ep.dist else ""
            requires = ep.dist.requires if ep.dist else None
            selected = {ep.name, dist}
            if (allow is not None and not selected & allow) or selected & deny:
                self.records.append(
                    BackendRecord(
                        ep.name,
                        "?",
                        ep.name,
                        dist,
                        version,
                        "disabled",
                        "excluded by RLCORE_PLUGINS / RLCORE_DISABLE_PLUGINS",
                    )
                )
                continue
            try:
                plugin = ep.load()
            except Exception as exc:
                incompatible = rlcore_requirement_problem(requires, dist) if requires else ""
                self._add_broken(ep.name, dist, version, exc, incompatible)
                continue
            self.register_plugin(
                plugin, name=f"{dist}:{ep.name}", distribution=dist, version=version, requires=requires
            )

    def _add_broken(self, plugin: str, dist: str, version: str, exc: BaseException, incompatible: str = "") -> None:
        status, problem = "broken", f"plugin failed to load: {_one_line(exc)}"
        if incompatible:  # most likely why: it uses what a newer rlcore has
            status, problem = "incompatible", f"{incompatible} (loading it failed: {_one_line(exc)})"
        self.records.append(BackendRecord(plugin, "?", plugin, dist, version, status, problem))

    def _add_refused(self, refused: Refusal, plugin: str, dist: str, version: str) -> None:
        """A spec the plugin made with a bad field: listed ``broken`` under the name it gave, with why and where."""
        name = refused.fields.get("name")
        kind = "algorithm" if isinstance(refused.spec, AlgorithmSpec) else getattr(refused.spec, "kind", "?")
        problem = f"{_one_line(refused.error)} (at {refused.where})"
        self.records.append(
            BackendRecord(
                name if isinstance(name, str) and name else plugin,
                kind,
                plugin,
                dist,
                version,
                "broken",
                problem,
                own=("broken", problem),
            )
        )

    def _add_spec(self, spec: Spec, plugin: str, dist: str, version: str, incompatible: str = "") -> None:
        if isinstance(spec, BackendSpec) and spec.kind == "environment":
            spec = EnvironmentSpec.from_backend_spec(spec)  # registered the rlcore 0.2 way
        kind = "algorithm" if isinstance(spec, AlgorithmSpec) else spec.kind
        record = BackendRecord(spec.name, kind, plugin, dist, version, spec=spec)
        record.own = ("incompatible", incompatible) if incompatible else _own_status(spec, dist)
        record.status, record.problem = record.own
        rivals = [
            r
            for r in self.records
            if r.spec is not None
            and r.name == spec.name
            and r.distribution != dist
            and group_of(r.kind) == group_of(kind)
        ]
        if rivals:
            for r in [*rivals, record]:
                others = [o.qualified_name for o in [*rivals, record] if o is not r]
                r.status = "conflict"
                r.problem = f"also provided by {', '.join(others)}; select one as '{r.qualified_name}'"
        self.records.append(record)

    # -- querying -----------------------------------------------------------
    def backends(self, kind: str | None = None) -> list[BackendRecord]:
        """Training and generation backends (of ``kind`` when given), and plugins that failed to register."""
        if kind == "environment":
            raise ValueError("environments are their own kind: use Registry.environments()")
        return [r for r in self.records if r.kind == "?" or (group_of(r.kind) == "backend" and kind in (None, r.kind))]

    def environments(self) -> list[BackendRecord]:
        """The registered environments, and plugins that failed to register (they may have provided one)."""
        return [r for r in self.records if r.kind in ("environment", "?")]

    def algorithms(self) -> list[BackendRecord]:
        """The registered algorithms (records of kind ``'algorithm'``)."""
        return [r for r in self.records if r.kind == "algorithm"]

    def tool_call_parsers(self) -> list[BackendRecord]:
        """The registered tool-call parsers (records of kind ``'tool_call_parser'``)."""
        return [r for r in self.records if r.kind == "tool_call_parser"]

    def resolve_tool_call_parser(self, name: str) -> ToolCallParserSpec:
        """The spec of an ``ok`` tool-call parser, by ``name`` or ``distribution:name``."""
        spec = self.resolve(name, kind="tool_call_parser")
        assert isinstance(spec, ToolCallParserSpec)
        return spec

    def resolve_algorithm(self, name: str) -> AlgorithmSpec:
        """The spec of an ``ok`` algorithm, by ``name`` or ``distribution:name``."""
        spec = self.resolve(name, kind="algorithm")
        assert isinstance(spec, AlgorithmSpec)
        return spec

    def resolve_environment(self, name: str) -> EnvironmentSpec:
        """The spec of an ``ok`` environment, by ``name`` or ``distribution:name``."""
        spec = self.resolve(name, kind="environment")
        assert isinstance(spec, EnvironmentSpec)
        return spec

    def resolve_backend(self, name: str, kind: str | None = None) -> BackendSpec:
        """The spec of an ``ok`` backend of ``kind`` (``'training'``, ``'generation'``; any when None)."""
        spec = self.resolve(name, kind)
        if not isinstance(spec, BackendSpec):
            raise BackendError(f"'{name}' names an environment, not a backend")
        return spec

    def resolve(self, name: str, kind: str | None = None) -> Spec:
        """The spec of an ``ok`` record of ``kind`` (a backend when None), by ``name`` or ``distribution:name``."""
        record = self.find(name, kind)
        noun = group_of(kind)
        if kind is not None and record.kind not in (kind, "?"):
            raise BackendError(f"backend '{name}' is a {record.kind} backend, not a {kind} backend")
        status, problem = record.status, record.problem
        if status == "conflict" and ":" in name and record.spec is not None:
            status, problem = record.own  # disambiguated by the user
        if status != "ok" or record.spec is None:
            raise BackendError(f"{noun} '{name}' is {status}: {problem}")
        return record.spec

    def find(self, name: str, kind: str | None = None) -> BackendRecord:
        """The record named ``name`` (``distribution:name``) among those of ``kind``'s group (backends when None):
        a backend, an environment and an algorithm may share a name."""
        group = group_of(kind)
        dist, sep, short = name.rpartition(":")
        same_group = [r for r in self.records if group_of(r.kind) == group or (r.kind == "?" and group != "algorithm")]
        matches = [r for r in same_group if r.name == short and (not sep or r.distribution == dist)]
        if matches:  # a spec before a refused one of the same name (from another distribution)
            return min(matches, key=lambda r: r.spec is None)
        known = sorted({r.name for r in same_group if r.spec is not None})
        failed = [r for r in same_group if r.kind == "?" and r.status in ("broken", "incompatible")]
        suspects = [r for r in failed if _normal(short) in _normal(r.distribution) + " " + _normal(r.name)]
        if suspects:  # the plugin that would provide it is there, and failed: say why, not "install it"
            r = suspects[0]
            raise BackendError(f"no {group} named '{name}': its plugin {r.qualified_name} is {r.status}: {r.problem}")
        raise BackendError(unknown_name_message(group, name, known, [r.qualified_name for r in failed]))


def _normal(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")


def _one_line(exc: BaseException) -> str:
    """``exc`` in one line: a refused ``BackendSpec`` as its field problems, anything else with where it was raised."""
    from pydantic import ValidationError

    if isinstance(exc, ValidationError):
        problems = [
            (".".join(map(str, e["loc"])) + ": " if e["loc"] else "") + e["msg"].removeprefix("Value error, ")
            for e in exc.errors()
        ]
        return f"{exc.title} refused: {'; '.join(problems)}"
    where = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    at = f" (at {where[0].filename}:{where[0].lineno})" if where else ""
    message = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {message}{at}"


def _own_status(spec: Spec, dist: str) -> tuple[str, str]:
    """Status of a spec on its own, before any name conflict is considered."""
    if missing := spec.missing_requirements():
        hint = f": {spec.install_hint}" if spec.install_hint else ""
        return "unavailable", f"missing {', '.join(missing)}{hint}"
    if isinstance(spec, EnvironmentSpec) and not spec.class_module_exists():
        return "broken", f"environment module of {spec.environment_class} is not installed: reinstall {dist}"
    if isinstance(spec, ToolCallParserSpec) and not spec.class_module_exists():
        return "broken", f"parser module of {spec.parser_class} is not installed: reinstall {dist}"
    if not isinstance(spec, BackendSpec):
        return "ok", ""
    if not spec.worker_module_exists():
        return "broken", f"worker module of {spec.worker_class} is not installed: reinstall {dist}"
    if problem := _capability_problem(spec):
        return "broken", problem
    return "ok", ""


def _capability_problem(spec: BackendSpec) -> str:
    """A declared capability whose method the training worker's source shows it lacks (empty when none, or when
    the source cannot tell without importing the class)."""
    if spec.kind != "training" or not any(c in CAPABILITY_METHODS for c in spec.capabilities):
        return ""
    methods = defined_methods(spec.worker_class)
    if methods is None:
        return ""
    for capability in sorted(spec.capabilities):
        if missing := [m for m in CAPABILITY_METHODS.get(capability, ()) if m not in methods]:
            return (
                f"declares capability '{capability}', but {spec.worker_class} has no {', '.join(missing)}: "
                f"implement {'it' if len(missing) == 1 else 'them'} or drop '{capability}' from its capabilities"
            )
    return ""


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
