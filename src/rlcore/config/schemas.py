"""The root config model and every section model, in one import place.

Adding a top-level section is one line in ``RLCoreConfig`` (plus, if it has
cross-field rules, one function registered in ``rlcore.config.rules``). An
algorithm's sections are not declared here: a plugin registers the algorithm
(:class:`rlcore.plugins.AlgorithmSpec`); its top-level key is validated by
the spec's ``config_class``, and the other top-level sections it owns (GRPO's
``loss``) by the classes its ``sections`` name (:func:`registered_algorithms`).
The config layer reaches them only through the registry, never by import.
"""

from __future__ import annotations

import difflib
from typing import Any

from pydantic import Field, PrivateAttr, ValidationError, model_serializer, model_validator
from pydantic_core import InitErrorDetails

from rlcore.config.base import SectionsModel, StrictModel
from rlcore.config.checkpointing import CheckpointingConfig
from rlcore.config.cluster import ClusterConfig
from rlcore.config.data import DataConfig, DatasetConfig, EnvConfig, legacy_task_sections
from rlcore.config.errors import ConfigError
from rlcore.config.generation import ColocationConfig, ColocationResources, GenerationConfig
from rlcore.config.logger import LoggerConfig
from rlcore.config.messages import problems_from_validation_error, show_value
from rlcore.config.policy import (
    DynamicBatchingConfig,
    PolicyConfig,
    Precision,
    PytorchOptimizerConfig,
    SchedulerMilestones,
    SequencePackingConfig,
    SinglePytorchSchedulerConfig,
    TokenizerConfig,
)
from rlcore.config.unknown_keys import unknown_keys


class RLCoreConfig(StrictModel):
    """A whole rlcore run: where it runs and what it trains.

    The algorithm's section (``grpo``, ``sft``, ``dpo``, ``distillation``, or a third party's) is a top-level key
    named after a registered algorithm (:func:`registered_algorithms`), validated by its spec's ``config_class``
    and read as an attribute (``cfg.<name>``: the section, or None when the config has none). A top-level section
    an algorithm owns (its spec's ``sections``: GRPO's ``loss``) is validated by its class and read the same way
    (``cfg.loss``: the section, or its defaults when the config leaves it out).
    """

    cluster: ClusterConfig = Field(default_factory=ClusterConfig, description="Workers and the Ray cluster.")
    policy: PolicyConfig = Field(default_factory=PolicyConfig, description="The policy and its training backend.")
    data: DataConfig = Field(
        default_factory=DataConfig,
        description="The samples: train and validation splits, and how a row becomes a prompt.",
    )
    env: EnvConfig = Field(default_factory=EnvConfig, description="The environment that scores completions.")
    logger: LoggerConfig = Field(default_factory=LoggerConfig, description="Metrics, plots and progress output.")
    checkpointing: CheckpointingConfig = Field(default_factory=CheckpointingConfig, description="Checkpoints.")
    _sections: dict[str, Any] = PrivateAttr(default_factory=dict)  # the algorithm sections, by algorithm name
    _owned: dict[str, Any] = PrivateAttr(default_factory=dict)  # the given sections algorithms own, by key

    @model_validator(mode="wrap")
    @classmethod
    def _algorithm_sections(cls, data: Any, handler: Any) -> Any:
        """Top-level keys naming a registered algorithm are validated by its config class; a key that is neither a
        field nor an algorithm is an unknown key (with the closest name). Problems keep their dotted paths."""
        if not isinstance(data, dict):
            return handler(data)
        data = dict(data)
        if "task" in data:  # rlcore 0.1's ``task`` section (two functions) still loads, as data and env
            data.update(legacy_task_sections(data.pop("task"), given=[k for k in ("data", "env") if k in data]))
        sections: dict[str, Any] = {}
        owned: dict[str, Any] = {}
        errors: list[Any] = []
        known, keys = registered_algorithms(), owned_section_keys()
        for key in [k for k in data if k not in cls.model_fields]:
            value = data.pop(key)
            if key in known or key in keys:
                if value is not None:  # null: no section (as a dumped config of another algorithm writes it)
                    (sections if key in known else owned)[key] = value
                continue
            close = difflib.get_close_matches(str(key), [*cls.model_fields, *known, *keys], n=1, cutoff=0.6)
            errors.append(_problem(str(key), "unknown key" + (f"; did you mean '{close[0]}'?" if close else "")))
        validated, validated_owned = {}, {}
        for key, value in sections.items():
            section, problems = _validated_section(key, value)
            validated[key] = section
            errors += [_problem(*line.split(": ", 1)) for line in problems]
        for key, value in owned.items():
            section, problems = _validated_section(keys[key], value, key)
            validated_owned[key] = section
            errors += [_problem(*line.split(": ", 1)) for line in problems]
        try:
            model = handler(data)
        except ValidationError as exc:
            errors = [_init_error(e) for e in exc.errors()] + errors
            model = None
        if errors:
            raise ValidationError.from_exception_data(cls.__name__, errors)
        model._sections = validated
        model._owned = validated_owned
        return model

    @model_serializer(mode="wrap")
    def _inline_algorithm_sections(self, handler: Any, info: Any) -> Any:
        """Each algorithm section under its own key, dumped as its model dumps itself, and each section an
        algorithm owns that the config gives (one it leaves out loads as its defaults again)."""
        data = handler(self)
        if isinstance(data, dict):
            for name, section in {**self._sections, **self._owned}.items():
                data[name] = section.model_dump(
                    mode=info.mode,
                    exclude_unset=info.exclude_unset,
                    exclude_defaults=info.exclude_defaults,
                    exclude_none=info.exclude_none,
                    by_alias=info.by_alias,
                )
        return data

    def __getattr__(self, name: str) -> Any:
        """``cfg.<algorithm>``: that algorithm's section, or None when the config has none."""
        if not name.startswith("_"):
            private = self.__pydantic_private__ or {}
            sections, owned = private.get("_sections") or {}, private.get("_owned") or {}
            if name in sections:
                return sections[name]
            if name in owned:
                return owned[name]
            if name in registered_algorithms():
                return None
            if name in owned_section_keys():
                return self.section_default(name)
        return super().__getattr__(name)  # type: ignore[misc]

    @property
    def owned_sections(self) -> dict[str, Any]:
        """The top-level sections owned by an algorithm (its spec's ``sections``) that the config gives."""
        return dict(self._owned)

    def section_default(self, name: str) -> Any:
        """The value of top-level section ``name`` when the config leaves it out."""
        if name in type(self).model_fields:
            return type(self).model_fields[name].get_default(call_default_factory=True)
        algorithm = owned_section_keys()[name]
        return registered_algorithms()[algorithm].load_section_class(name)()

    @property
    def algorithm_sections(self) -> dict[str, Any]:
        """The config's algorithm sections, ``{name: validated section}`` (at most one in a valid config)."""
        return dict(self._sections)

    @property
    def algorithm(self) -> str:
        """What ``rlcore run`` trains: the algorithm whose section the config has, else the default one (GRPO);
        a config with two is refused by :mod:`rlcore.config.rules`."""
        return next(iter(self._sections), None) or default_algorithm()

    @property
    def algorithm_section(self) -> Any:
        """The section of the algorithm ``rlcore run`` trains (None for the default algorithm until
        :func:`rlcore.config.resolve` fills it in for a run); every algorithm names its seed, steps, epochs and
        validation schedule alike (NeMo-RL's names)."""
        return self._sections.get(self.algorithm)

    @property
    def world_size(self) -> int:
        """Training ranks: ``cluster.num_nodes * cluster.workers_per_node`` (the data-parallel size follows
        from the training backend's layout: :func:`rlcore.config.resolve`)."""
        return self.cluster.world_size


def registered_algorithms(registry: Any = None) -> dict[str, Any]:
    """``{name: AlgorithmSpec}`` of the algorithms a config may name: ``registry``'s (default: the process-wide
    one), then the installed ones (a registry a test or the backend kit swapped in may hold backends only)."""
    from rlcore.plugins import get_registry

    specs = {r.name: r.spec for r in _installed_registry().algorithms() if r.spec is not None}
    specs.update({r.name: r.spec for r in (registry or get_registry()).algorithms() if r.spec is not None})
    return specs


def owned_section_keys(registry: Any = None) -> dict[str, str]:
    """``{top-level key: algorithm}`` of the sections registered algorithms own besides their own (their spec's
    ``sections``, e.g. ``{'loss': 'grpo'}``); a key that is a core field or an algorithm's name is not one."""
    specs = registered_algorithms(registry)
    found: dict[str, str] = {}
    for name, spec in sorted(specs.items()):
        for key in spec.sections:
            if key not in RLCoreConfig.model_fields and key not in specs:
                found.setdefault(key, name)
    return found


def load_algorithm(name: str, registry: Any = None) -> Any:
    """The algorithm unit (:class:`rlcore.interfaces.algorithm.Algorithm`) registered as ``name``; its class is
    imported here, so only a run calls this."""
    spec = registered_algorithms(registry)[name]
    return spec.load_algorithm_class()(spec.name, spec.generates)


def default_algorithm() -> str:
    """The algorithm a config without an algorithm section trains: the one whose spec says ``default``."""
    defaults = sorted(name for name, spec in registered_algorithms().items() if spec.default)
    if not defaults:
        raise ConfigError(
            [
                "(top level): no installed algorithm is the default; add an algorithm section (e.g. grpo) "
                "or reinstall rlcore"
            ]
        )
    if len(defaults) > 1:  # two plugins claim it: choosing one by name would be a silent guess
        raise ConfigError(
            [
                f"(top level): the installed algorithms {', '.join(defaults)} each say they are the "
                "default; add the section of the one to train"
            ]
        )
    return defaults[0]


_INSTALLED: list[Any] = []  # the registry of the installed entry points, built on first use


def _installed_registry() -> Any:
    from rlcore.plugins import Registry

    if not _INSTALLED:
        registry = Registry()
        registry.load_entry_points()
        _INSTALLED.append(registry)
    return _INSTALLED[0]


def _validated_section(algorithm: str, value: Any, key: str | None = None) -> tuple[Any, list[str]]:
    """An algorithm's section (``key`` None) or a top-level section ``key`` it owns, validated by its class (an
    instance of it passes as is), or its problems."""
    spec = registered_algorithms()[algorithm]
    path = key or algorithm
    if missing := spec.missing_requirements():
        hint = f": {spec.install_hint}" if spec.install_hint else ""
        return None, [f"{path}: the '{algorithm}' algorithm needs {', '.join(missing)}, which is not installed{hint}"]
    class_path = spec.config_class if key is None else spec.sections[key]
    try:
        model = spec.load_config_class() if key is None else spec.load_section_class(key)
    except Exception as exc:  # noqa: BLE001 - a plugin's import error, reported as a config problem
        return None, [f"{path}: cannot import config class {class_path}: {exc}"]
    if isinstance(value, model):
        return value, []
    if not isinstance(value, dict):
        return None, [f"{path}: expected a mapping (key: value), got {show_value(value)}"]
    try:
        validated = model.model_validate(value)
    except ValidationError as exc:
        return None, problems_from_validation_error(exc, model, path)
    return (None, problems) if (problems := unknown_keys(model, value, path)) else (validated, [])


def _problem(path: str, text: str) -> InitErrorDetails:
    """A problem line as a pydantic error whose location is the whole dotted ``path``."""
    return InitErrorDetails(type="value_error", loc=(path,), input=None, ctx={"error": ValueError(text)})


def _init_error(err: Any) -> InitErrorDetails:
    return InitErrorDetails(**{k: err[k] for k in ("type", "loc", "input", "ctx") if k in err})


def config_json_schema() -> dict[str, Any]:
    """JSON schema (draft 2020-12) of ``RLCoreConfig`` as accepted on input."""
    schema = RLCoreConfig.model_json_schema(mode="validation")
    keys = owned_section_keys()
    for name, spec in sorted(registered_algorithms().items()):
        if spec.missing_requirements():
            continue
        owned = {key: spec.load_section_class(key) for key in spec.sections if keys.get(key) == name}
        for key, model in [(name, spec.load_config_class()), *owned.items()]:
            section = model.model_json_schema(mode="validation", ref_template="#/$defs/{model}")
            schema.setdefault("$defs", {}).update(section.pop("$defs", {}))
            what = (spec.description or f"The {name} algorithm's section.") if key == name else _first_line(model)
            schema["properties"][key] = {"anyOf": [section, {"type": "null"}], "description": what}
    return schema


def _first_line(model: type) -> str:
    return ((model.__doc__ or "").strip().splitlines() or [model.__name__])[0]


__all__ = [
    "CheckpointingConfig",
    "LoggerConfig",
    "DataConfig",
    "DatasetConfig",
    "EnvConfig",
    "ClusterConfig",
    "ColocationConfig",
    "ColocationResources",
    "DynamicBatchingConfig",
    "GenerationConfig",
    "PolicyConfig",
    "Precision",
    "PytorchOptimizerConfig",
    "RLCoreConfig",
    "SchedulerMilestones",
    "SectionsModel",
    "SequencePackingConfig",
    "SinglePytorchSchedulerConfig",
    "StrictModel",
    "TokenizerConfig",
    "config_json_schema",
    "default_algorithm",
    "load_algorithm",
    "owned_section_keys",
    "registered_algorithms",
]
