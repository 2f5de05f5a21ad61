"""``AlgorithmSpec``: what a plugin declares about one training algorithm, without importing it."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rlcore.plugins.spec import import_object, module_exists


class AlgorithmSpec(BaseModel):
    """An algorithm ``rlcore run`` can train (GRPO, SFT, DPO, distillation, or a third party's).

    A config selects it by having a top-level section named ``name``. ``config_class`` validates that
    section and is imported when a config is checked, so its module must be light; ``algorithm_class`` is
    the unit that prepares the data and runs the loop, imported only by the run that uses it.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(description="The algorithm's name, which is also its config section's key, e.g. 'grpo'.")
    config_class: str = Field(description="'module:Class' of the pydantic model of the config section (light).")
    algorithm_class: str = Field(description="'module:Class' of the algorithm unit, imported only by 'rlcore run'.")
    requires: tuple[str, ...] = Field(default=(), description="Top-level modules the algorithm needs.")
    install_hint: str = Field(default="", description="How to install what 'requires' names.")
    description: str = ""
    default: bool = Field(
        default=False,
        description="The algorithm a config without any algorithm section "
        "trains (rlcore's own GRPO); at most one installed algorithm should say so.",
    )
    generates: bool = Field(
        default=False,
        description="Its loop generates and scores rollouts: a run needs policy.generation and an environment (env).",
    )
    unread_sections: dict[str, str] = Field(
        default_factory=dict,
        description="Top-level sections its run does not read, with what they hold: "
        "{'loss': 'the policy-gradient loss'}. A config that sets one away from its defaults is refused rather "
        "than silently ignored.",
    )

    sections: dict[str, str] = Field(
        default_factory=dict,
        description="Top-level sections the algorithm owns besides its own, with the 'module:Class' of the pydantic "
        "model that validates each (light, like config_class): {'loss': 'mypkg.config:MyLossConfig'}. Validated "
        "like the algorithm's section, with dotted paths; read as cfg.<key> (the defaults when the config leaves it "
        "out). Added in rlcore 0.2.",
    )
    rules: str | None = Field(
        default=None,
        description="'module:function' of the algorithm's cross-field rules (light): called with the validated "
        "whole config, it yields one problem line per problem, starting with the dotted path. Run by 'rlcore "
        "config validate' and every run when the config trains this algorithm or sets a section it owns. Added "
        "in rlcore 0.2.",
    )

    @field_validator("name")
    @classmethod
    def _name_is_identifier(cls, v: str) -> str:
        if not v.isidentifier():
            raise ValueError(f"an algorithm's name is its config section's key, a Python identifier; got {v!r}")
        return v

    @field_validator("config_class", "algorithm_class")
    @classmethod
    def _is_import_path(cls, v: str) -> str:
        if v.count(":") != 1 or v.startswith(":") or v.endswith(":"):
            raise ValueError(f"expected 'module:Name', got {v!r}")
        return v

    @field_validator("sections")
    @classmethod
    def _sections_are_keys_and_import_paths(cls, v: dict[str, str]) -> dict[str, str]:
        for key, path in v.items():
            if not key.isidentifier():
                raise ValueError(f"a section's key is a top-level config key, a Python identifier; got {key!r}")
            cls._is_import_path(path)
        return v

    @field_validator("rules")
    @classmethod
    def _rules_is_import_path(cls, v: str | None) -> str | None:
        return None if v is None else cls._is_import_path(v)

    def missing_requirements(self) -> list[str]:
        """Required modules that are not installed (checked without importing them)."""
        return [module for module in self.requires if not module_exists(module)]

    def load_config_class(self) -> Any:
        return import_object(self.config_class)

    def load_algorithm_class(self) -> Any:
        return import_object(self.algorithm_class)

    def load_section_class(self, key: str) -> type[BaseModel]:
        """The model of the top-level section ``key`` the algorithm owns (:attr:`sections`)."""
        model: type[BaseModel] = import_object(self.sections[key])
        return model

    def load_rules(self) -> Callable[[Any], Iterable[str]] | None:
        """The algorithm's rule function (:attr:`rules`), or None when it declares none."""
        if self.rules is None:
            return None
        check: Callable[[Any], Iterable[str]] = import_object(self.rules)
        return check
