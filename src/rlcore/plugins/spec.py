"""``BackendSpec``: what a plugin declares about one backend, without importing it."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Iterable
from importlib.machinery import ModuleSpec
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rlcore.plugins.capabilities import Capability, parse_capabilities
from rlcore.plugins.layout import LayoutRequest, ParallelLayout

BackendKind = Literal["training", "generation", "environment"]
#: A training backend's layout function (``BackendSpec.layout``).
LayoutFunction = Callable[[LayoutRequest], ParallelLayout]
#: A training backend's config check (``BackendSpec.config_check``): one problem line per setting it cannot run.
ConfigCheck = Callable[[LayoutRequest], list[str]]


def find_module_spec(name: str) -> ModuleSpec | None:
    """The import spec of ``name`` (possibly dotted), found without importing any of it; None when not installed."""
    from importlib.machinery import PathFinder

    top, *rest = name.split(".")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    for part in rest:
        if spec is None or spec.submodule_search_locations is None:
            return None
        spec = PathFinder.find_spec(part, list(spec.submodule_search_locations))
    return spec


def module_exists(name: str) -> bool:
    """Whether ``name`` (possibly dotted) is installed, found without importing any of it."""
    return find_module_spec(name) is not None


def import_object(path: str) -> Any:  # type: ignore[explicit-any]  # what a path names is known at run time only
    """Import ``"package.module:Qualified.Name"`` and return the object."""
    module_name, sep, qualname = path.partition(":")
    if not sep or not module_name or not qualname:
        raise ValueError(f"expected 'module:Class', got {path!r}")
    obj: object = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


class BackendSpec(BaseModel):
    """A training or generation backend, declared by a plugin.

    ``worker_class`` and ``config_class`` are ``"module:Class"`` strings so that
    listing backends never imports them (vLLM's model-registry idea).
    ``requires`` names the top-level modules the backend's engine needs
    (``"torch"``, ``"vllm"``, ``"megatron.core"``); a missing one makes the
    backend ``unavailable`` with ``install_hint`` as the fix.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(description="Backend name users select in configs, e.g. 'dtensor'.")
    kind: BackendKind = Field(
        description="'training' (a policy worker) or 'generation' (an engine). "
        "'environment' is still accepted and registers an rlcore.plugins.EnvironmentSpec "
        "(new plugins use rlcore_register_environments)."
    )
    worker_class: str = Field(
        description="'module:Class' of the Ray worker, imported only inside the worker (for "
        "kind 'environment': the environment class)."
    )
    driver_class: str | None = Field(
        default=None,
        description="'module:Class' of the driver-side facade of a generation backend, built as "
        "Class(cluster, generation_config, tokenizer=...) and implementing GenerationInterface. Imported on "
        "the driver, so its module must not import the engine at top level.",
    )
    config_class: str | None = Field(
        default=None,
        description="'module:Class' of a pydantic model validating this backend's config section "
        "('policy.<name>_cfg' or 'policy.generation.<name>_cfg'). Must be importable without heavy deps.",
    )
    capabilities: frozenset[Capability] = Field(
        default=frozenset(),
        description="Features the backend supports: members (or names) of rlcore.plugins.Capability, e.g. "
        "'refit', 'sequence_packing', 'dynamic_batching'. An unknown name is refused at registration.",
    )
    layout: str | None = Field(
        default=None,
        description="'module:function' of a training backend's layout function (since rlcore 0.2): given a "
        "rlcore.plugins.LayoutRequest, it returns the rlcore.plugins.ParallelLayout the policy runs with. "
        "None = pure data parallel. Imported on the driver: keep its module light.",
    )
    config_check: str | None = Field(
        default=None,
        description="'module:function' (since rlcore 0.2) given the same rlcore.plugins.LayoutRequest, returning one "
        "problem line per setting this backend cannot run (settings outside its own section, or that depend on "
        "the cluster); the config is refused before anything starts. Imported on the driver: keep it light.",
    )
    requires: tuple[str, ...] = Field(default=(), description="Top-level modules the engine needs.")
    install_hint: str = Field(default="", description="How to install what 'requires' names.")
    checks: str | None = Field(
        default=None,
        description="'module:function' of the backend's own host checks: called with "
        "rlcore.preflight.HostFacts, it returns rlcore.preflight.CheckResult lines. rlcore doctor shows them; "
        "rlcore run and config validate refuse a run of this backend on a failed one. Imported only when checks "
        "run: keep it light. None = the backend's host is not checked.",
    )
    import_check: str | None = Field(
        default=None,
        description="'module:Attr' rlcore doctor imports to tell the engine works, instead of the plain import of "
        "that module of 'requires': for an engine that imports lazily, e.g. 'vllm:LLM'.",
    )
    plugin_api_version: int | None = Field(
        default=None,
        description="Deprecated, ignored (since rlcore 0.2; kept so that specs declaring it still load): "
        "constructors get the keyword arguments they declare, and a plugin states the rlcore it needs as its "
        "distribution's requirement (rlcore>=X). Leave it out.",
    )
    description: str = ""

    @field_validator("name")
    @classmethod
    def _name_is_simple(cls, v: str) -> str:
        if not v or not v.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"backend name must be alphanumeric with '-' or '_', got {v!r}")
        return v

    @field_validator("worker_class", "config_class", "driver_class", "layout", "config_check", "checks", "import_check")
    @classmethod
    def _is_import_path(cls, v: str | None) -> str | None:
        if v is not None and (v.count(":") != 1 or v.startswith(":") or v.endswith(":")):
            raise ValueError(f"expected 'module:Name', got {v!r}")
        return v

    @field_validator("capabilities", mode="before")
    @classmethod
    def _known_capabilities(cls, v: object) -> frozenset[Capability]:
        if not isinstance(v, Iterable):
            raise ValueError(f"capabilities is a set of names, got {v!r}")
        return parse_capabilities(v)

    @model_validator(mode="after")
    def _fields_of_its_kind(self) -> BackendSpec:
        if self.layout is not None and self.kind != "training":
            raise ValueError("layout is a training backend's; a generation backend lays out its engines itself")
        if self.kind == "environment" and (
            extra := [f for f in ("driver_class", "config_check", "capabilities") if getattr(self, f)]
        ):
            raise ValueError(
                f"{', '.join(extra)}: not fields of an environment (it declares worker_class, config_class, requires)"
            )
        return self

    def supports(self, capability: Capability) -> bool:
        """Whether the backend declares ``capability`` (a member: a misspelt one fails where it is written)."""
        return Capability(capability) in self.capabilities

    def missing_requirements(self) -> list[str]:
        """Required modules that are not installed (checked without importing them)."""
        return [module for module in self.requires if not module_exists(module)]

    def worker_module_exists(self) -> bool:
        """Whether the worker's module is installed (checked without importing it)."""
        return module_exists(self.worker_class.partition(":")[0])

    def load_worker_class(self) -> type:
        return import_object(self.worker_class)

    def load_driver_class(self) -> type | None:
        return import_object(self.driver_class) if self.driver_class else None

    def load_config_class(self) -> type[BaseModel] | None:
        return import_object(self.config_class) if self.config_class else None

    def load_layout(self) -> LayoutFunction | None:
        """The layout function, or None for a pure data-parallel backend."""
        return import_object(self.layout) if self.layout else None

    def load_config_check(self) -> ConfigCheck | None:
        """The config check function, or None."""
        return import_object(self.config_check) if self.config_check else None
