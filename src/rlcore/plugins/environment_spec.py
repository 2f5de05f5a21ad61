"""``EnvironmentSpec``: what a plugin declares about one environment, without importing it."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rlcore.plugins.capabilities import Capability
from rlcore.plugins.spec import BackendSpec, import_object, module_exists
from rlcore.plugins.spec_refusals import KeptWhenRefused


class EnvironmentSpec(KeptWhenRefused, BaseModel):
    """An environment that scores rollouts (``rlcore.interfaces.environment``), selected by ``env.name``.

    The core builds ``Class(config)`` in the driver or in ``env.num_workers`` Ray actors, ``config`` being the
    ``env.<name>_cfg`` section validated with ``config_class`` (None without one). A spec with a bad field raises,
    except inside the registry's hook call, where it is listed ``broken`` beside its plugin's other environments
    (:mod:`rlcore.plugins.spec_refusals`).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(description="The name a config selects as env.name, e.g. 'math'.")
    environment_class: str = Field(description="'module:Class' of the environment, imported where it runs.")
    config_class: str | None = Field(
        default=None,
        description="'module:Class' of a pydantic model validating env.<name>_cfg. Must be importable without "
        "heavy dependencies.",
    )
    requires: tuple[str, ...] = Field(default=(), description="Top-level modules the environment needs.")
    install_hint: str = Field(default="", description="How to install what 'requires' names.")
    description: str = ""

    @field_validator("name")
    @classmethod
    def _name_is_simple(cls, v: str) -> str:
        if not v or not v.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"environment name must be alphanumeric with '-' or '_', got {v!r}")
        return v

    @field_validator("environment_class", "config_class")
    @classmethod
    def _is_import_path(cls, v: str | None) -> str | None:
        if v is not None and (v.count(":") != 1 or v.startswith(":") or v.endswith(":")):
            raise ValueError(f"expected 'module:Name', got {v!r}")
        return v

    @classmethod
    def from_backend_spec(cls, spec: BackendSpec) -> EnvironmentSpec:
        """An environment registered the rlcore 0.2 way, as a ``BackendSpec(kind="environment")``."""
        return cls(
            name=spec.name,
            environment_class=spec.worker_class,
            config_class=spec.config_class,
            requires=spec.requires,
            install_hint=spec.install_hint,
            description=spec.description,
        )

    # What code written for environments registered as backends reads (rlcore 0.2): the same facts.
    @property
    def kind(self) -> str:
        return "environment"

    @property
    def capabilities(self) -> frozenset[Capability]:
        return frozenset()

    @property
    def worker_class(self) -> str:
        """``environment_class`` under the name a ``BackendSpec`` of kind ``environment`` gave it."""
        return self.environment_class

    def missing_requirements(self) -> list[str]:
        """Required modules that are not installed (checked without importing them)."""
        return [module for module in self.requires if not module_exists(module)]

    def class_module_exists(self) -> bool:
        """Whether the environment's module is installed (checked without importing it)."""
        return module_exists(self.environment_class.partition(":")[0])

    def load_environment_class(self) -> type:
        return import_object(self.environment_class)

    def load_config_class(self) -> type[BaseModel] | None:
        return import_object(self.config_class) if self.config_class else None
