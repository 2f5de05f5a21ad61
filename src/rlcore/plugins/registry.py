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
from rlcore.plugins.spec import SUPPORTED_PLUGIN_API_VERSIONS, BackendSpec

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
    spec: BackendSpec | None = None

    @property
    def qualified_name(self) -> str:
        return f"{self.distribution}:{self.name}"

    def as_dict(self) -> dict[str, Any]:
        caps = sorted(self.spec.capabilities) if self.spec else []
        return {
            "name": self.name,
            "kind": self.kind,
            "plugin": self.plugin,
            "distribution": self.distribution,
            "version": self.version,
            "status": self.status,
            "capabilities": caps,
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
        specs: list[BackendSpec] = []
        try:
            self._pm.register(plugin, name=name)
            for impl in self._pm.hook.rlcore_register_backends.get_hookimpls():
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
        where = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
        at = f" (at {where[0].filename}:{where[0].lineno})" if where else ""
        self.records.append(
            BackendRecord(plugin, "?", plugin, dist, version, "broken",
                          f"plugin failed to load: {type(exc).__name__}: {exc}{at}")
        )

    def _add_spec(self, spec: BackendSpec, plugin: str, dist: str, version: str) -> None:
        record = BackendRecord(spec.name, spec.kind, plugin, dist, version, spec=spec)
        record.status, record.problem = _own_status(spec, dist)
        rivals = [r for r in self.records if r.spec is not None and r.name == spec.name and r.distribution != dist]
        if rivals:
            for r in [*rivals, record]:
                others = [o.qualified_name for o in [*rivals, record] if o is not r]
                r.status = "conflict"
                r.problem = f"also provided by {', '.join(others)}; select one as '{r.qualified_name}'"
        self.records.append(record)

    # -- querying -----------------------------------------------------------
    def backends(self, kind: str | None = None) -> list[BackendRecord]:
        return [r for r in self.records if kind is None or r.kind in (kind, "?")]

    def resolve(self, name: str, kind: str | None = None) -> BackendSpec:
        """The spec of an ``ok`` backend, by ``name`` or ``distribution:name``."""
        record = self.find(name)
        if kind is not None and record.kind != kind:
            raise BackendError(f"backend '{name}' is a {record.kind} backend, not a {kind} backend")
        status, problem = record.status, record.problem
        if status == "conflict" and ":" in name and record.spec is not None:
            status, problem = _own_status(record.spec, record.distribution)  # disambiguated by the user
        if status != "ok" or record.spec is None:
            raise BackendError(f"backend '{name}' is {status}: {problem}")
        return record.spec

    def find(self, name: str) -> BackendRecord:
        dist, sep, short = name.rpartition(":")
        matches = [r for r in self.records if r.name == short and (not sep or r.distribution == dist)]
        if not matches:
            known = sorted({r.name for r in self.records if r.spec is not None})
            close = difflib.get_close_matches(short, known, n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            installed = ", ".join(known) or "none"
            raise BackendError(
                f"no backend named '{name}' (installed: {installed}); {hint}"
                f"install the plugin that provides it, e.g. 'pip install rl-{short}'"
            )
        return matches[0]


def _own_status(spec: BackendSpec, dist: str) -> tuple[str, str]:
    """Status of a spec on its own, before any name conflict is considered."""
    if spec.plugin_api_version not in SUPPORTED_PLUGIN_API_VERSIONS:
        return "incompatible", (
            f"declares plugin API version {spec.plugin_api_version}; this rlcore supports "
            f"{sorted(SUPPORTED_PLUGIN_API_VERSIONS)}: upgrade rlcore or install a matching {dist}"
        )
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


def own_section(spec: BackendSpec, owner: Any) -> Any:
    """The backend's own ``<name>_cfg`` section of ``owner`` (a policy or generation config), validated
    with its ``config_class``: the object workers get as ``backend_config`` (None without a config class).

    Raises ConfigError (dotted path, one line per problem) for an invalid section.
    """
    from rlcore.config import ConfigError, validate_section

    model = spec.load_config_class()
    if model is None:
        return None
    key = f"{spec.name}_cfg"
    if isinstance(getattr(owner, key, None), model):
        return getattr(owner, key)  # a section the core schema declares (dtensor_cfg): validated already
    path = "policy" if hasattr(owner, "training_backend") else "policy.generation"
    section = (getattr(owner, "backend_sections", None) or {}).get(key, {})
    validated, problems = validate_section(model, section, f"{path}.{key}")
    if validated is None:
        raise ConfigError(problems)
    return validated


def lora_problems(policy: Any, registry: Registry) -> list[str]:
    """``policy.lora`` needs a training backend declaring 'lora'; adapter refits an engine declaring
    'lora_adapter'."""
    if not policy.lora.enabled:
        return []
    with_lora = sorted(r.name for r in registry.records if r.spec is not None and r.spec.kind == "training"
                       and "lora" in r.spec.capabilities)
    try:
        spec = registry.resolve(policy.training_backend, kind="training")
    except BackendError:
        return []  # reported by the backend check
    if "lora" not in spec.capabilities:
        return [f"policy.lora.enabled: the '{spec.name}' training backend does not train LoRA adapters "
                f"(no 'lora' capability); use one that does ({', '.join(with_lora) or 'none installed'}) or set "
                "policy.lora.enabled=false"]
    gen = policy.generation
    if policy.lora.refit == "adapter" and gen is not None and gen.backend != policy.training_backend:
        try:
            gen_spec = registry.resolve(gen.backend, kind="generation")
        except BackendError:
            return []
        if "lora_adapter" not in gen_spec.capabilities:
            return [f"policy.lora.refit: 'adapter' needs a generation backend that applies LoRA adapters itself "
                    f"('lora_adapter' capability), and '{gen_spec.name}' does not declare it; use "
                    "policy.lora.refit=merged"]
    return []


def validate_backend_sections(cfg: Any, registry: Registry | None = None) -> list[str]:
    """Check the backends a config selects, and their own config sections.

    Returns one problem line per issue (empty when fine). A selected backend
    must be installed and ``ok``; a ``<name>_cfg`` section under ``policy`` or
    ``policy.generation`` is validated with that backend's own config class;
    a section naming no known backend is reported with the closest name.
    """
    from rlcore.config import ConfigError

    registry = registry or get_registry()
    problems: list[str] = []
    known = {r.name for r in registry.records if r.spec is not None}

    def check(owner: Any, path: str, name: str, kind: str, name_path: str) -> None:
        try:
            spec = registry.resolve(name, kind=kind)
        except BackendError as exc:
            problems.append(f"{name_path}: {exc}")
            spec = None
        for key in getattr(owner, "backend_sections", None) or {}:
            backend = key[: -len("_cfg")]
            if backend not in known:
                close = difflib.get_close_matches(backend, sorted(known), n=1)
                hint = f"; did you mean '{close[0]}_cfg'?" if close else ""
                problems.append(f"{path}.{key}: no installed backend named '{backend}'{hint}")
            elif spec is not None and backend == spec.name and spec.config_class:
                try:
                    own_section(spec, owner)  # what the workers will get, validated the same way
                except ConfigError as exc:
                    problems.extend(exc.problems)
                except Exception as exc:
                    problems.append(f"{path}.{key}: cannot import config class {spec.config_class}: {exc}")

    policy = cfg.policy
    check(policy, "policy", policy.training_backend, "training",
          "policy.backend" if policy.backend else "policy (training backend)")
    problems += lora_problems(policy, registry)
    if policy.generation is not None:
        gen = policy.generation
        if gen.backend != policy.training_backend:
            check(gen, "policy.generation", gen.backend, "generation", "policy.generation.backend")
        else:
            spec = registry.resolve(policy.training_backend) if not problems else None
            if spec is not None and "generate" not in spec.capabilities:
                problems.append(f"policy.generation.backend: training backend '{gen.backend}' cannot generate; "
                                "use a generation backend such as 'vllm'")
    return problems
