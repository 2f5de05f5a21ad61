"""The backends a config selects, checked against the installed plugins: their specs, their own
``<name>_cfg`` sections, their layout, and the capabilities the config needs from them.

Each function returns problem lines (``<dotted path>: <what is wrong>; <the fix>``) or raises
:class:`~rlcore.config.ConfigError`; :func:`rlcore.config.resolve` collects them.
"""

from __future__ import annotations

import difflib
from typing import Any

from rlcore.config.base import SECTION_SUFFIX
from rlcore.config.errors import ConfigError
from rlcore.config.loader import validate_section
from rlcore.config.policy import FALLBACK_TRAINING_BACKEND
from rlcore.plugins import (
    BackendError,
    BackendSpec,
    Capability,
    LayoutRequest,
    ParallelLayout,
    Registry,
    declared_kwargs,
)
from rlcore.plugins.layout import DATA_PARALLEL


def select(registry: Registry, name: str, kind: str, path: str) -> tuple[BackendSpec | None, list[str]]:
    """The ``ok`` spec of backend ``name``, or None and the problem (named by the config ``path``)."""
    try:
        return registry.resolve(name, kind=kind), []
    except BackendError as exc:
        return None, [f"{path}: {exc}"]


def selection_path(policy: Any) -> str:
    """The setting that chose the policy's training backend, named in a problem with it."""
    if policy.backend:
        return "policy.backend"
    key = f"{policy.training_backend}{SECTION_SUFFIX}"
    if policy.backend_sections.get(key, {}).get("enabled") is True:
        return f"policy.{key}.enabled"
    return "policy (training backend)"


def self_generating(registry: Registry, training: str) -> str | None:
    """The training backend a run falls back to when its generation engine is not installed: ``training``
    itself if it generates (capability 'generate'), else the fall-back backend if it is installed and does."""
    for name in dict.fromkeys((training, FALLBACK_TRAINING_BACKEND)):
        try:
            spec = registry.resolve(name, kind="training")
        except BackendError:
            continue
        if spec.supports(Capability.GENERATE):
            return spec.name
    return None


def own_section(spec: BackendSpec, owner: Any, path: str) -> Any:
    """The backend's own ``<name>_cfg`` section of ``owner`` (the policy or the generation config at
    ``path``), validated with its ``config_class``; None without a config class, the defaults when absent.

    The class is validated with ``owner`` in pydantic's validation context (``info.context["owner"]``), so a
    backend may derive a setting left null from the policy (megatron's lr from ``policy.learning_rate``).
    Raises ConfigError (dotted path, one line per problem).
    """
    key = f"{spec.name}{SECTION_SUFFIX}"
    try:
        model = spec.load_config_class()
    except Exception as exc:  # noqa: BLE001 - a plugin's import error, reported as a config problem
        raise ConfigError([f"{path}.{key}: cannot import config class {spec.config_class}: {exc}"]) from exc
    if model is None:
        return None
    if isinstance(getattr(owner, key, None), model):
        return getattr(owner, key)  # a section the owner's own schema declares: validated already
    section = (getattr(owner, "backend_sections", None) or {}).get(key, {})
    validated, problems = validate_section(model, section, f"{path}.{key}", context={"owner": owner})
    if validated is None:
        raise ConfigError(problems)
    return validated


def disabled(section: Any) -> bool:
    """A section that says ``enabled: false`` (NeMo-RL's files carry every backend's section, all but one off)."""
    return isinstance(section, dict) and section.get("enabled") is False


def other_sections(owner: Any, path: str, registry: Registry, selected: str | None) -> list[str]:
    """Problems of the ``*_cfg`` sections under ``path`` other than the ``selected`` backend's (whose own
    resolution reports them): a section naming no installed backend (one line, with how to install it), or one
    its installed backend's config class refuses. A section of a backend that is not installed is accepted when it
    says ``enabled: false`` (NeMo-RL's files carry every backend's section, all but one off)."""
    known = sorted({r.name for r in registry.backends() if r.spec is not None})
    problems = []
    for key, section in (getattr(owner, "backend_sections", None) or {}).items():
        backend = key[: -len(SECTION_SUFFIX)]
        if backend == selected:
            continue
        if backend not in known:
            if disabled(section):
                continue
            close = difflib.get_close_matches(backend, known, n=1)
            problems.append(
                f"{path}.{key}: no installed backend named '{backend}'; did you mean '{close[0]}{SECTION_SUFFIX}'?"
                if close
                else f"{path}.{key}: {_missing(registry, backend)}"
            )
            continue
        spec = next(r.spec for r in registry.backends() if r.name == backend and r.spec is not None)
        try:
            own_section(spec, owner, path)
        except ConfigError as exc:
            problems += exc.problems
    return problems


def _missing(registry: Registry, backend: str) -> str:
    """Why no backend is named ``backend``, and how to install it: the registry's words (a plugin of that name
    that failed to load says why)."""
    try:
        record = registry.find(backend)
    except BackendError as exc:
        return str(exc)
    return f"backend '{backend}' is {record.status}: {record.problem}"


def layout_of(spec: BackendSpec, request: LayoutRequest) -> ParallelLayout:
    """The training backend's layout for ``request`` (pure data parallel without a layout function).

    Raises ConfigError with the backend's problem lines for a layout it cannot run, or one naming the
    backend's world size problem.
    """
    function = spec.load_layout()
    if function is None:
        return DATA_PARALLEL
    try:
        layout = function(request)
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError(str(exc).splitlines()) from exc
    if not isinstance(layout, ParallelLayout):
        raise ConfigError(
            [
                f"policy: the layout function {spec.layout} of backend '{spec.name}' returned "
                f"{type(layout).__name__}, not a rlcore.plugins.ParallelLayout"
            ]
        )
    world, size = request.world_size, layout.model_parallel_size
    if world % size:
        raise ConfigError(
            [
                f"{', '.join(layout.setting_paths())}: {layout.describe()} does not divide the world "
                f"size {world} (cluster.num_nodes × cluster.workers_per_node); choose sizes whose product "
                f"divides {world}, or a cluster of a multiple of {size} ranks"
            ]
        )
    return layout


def check_problems(spec: BackendSpec, request: LayoutRequest) -> list[str]:
    """What the backend's own config check says of ``request`` (nothing without one)."""
    function = spec.load_config_check()
    if function is None:
        return []
    problems = function(request)
    if not isinstance(problems, (list, tuple)) or not all(isinstance(p, str) for p in problems):
        return [
            f"policy: the config check {spec.config_check} of backend '{spec.name}' returned "
            f"{type(problems).__name__}, not a list of problem lines"
        ]
    return list(problems)


def first_per_path(problems: list[str]) -> list[str]:
    """One line per dotted path (a capability problem and a backend's own check may name the same key)."""
    seen: set[str] = set()
    out = []
    for line in problems:
        path = line.split(":", 1)[0]
        if path not in seen:
            seen.add(path)
            out.append(line)
    return out


def capability_problems(policy: Any, spec: BackendSpec, packing: bool) -> list[str]:
    """Batching modes and logprob chunking the config turns on that the training backend does not declare."""
    wanted = [
        (
            "policy.dynamic_batching.enabled",
            policy.dynamic_batching.enabled,
            Capability.DYNAMIC_BATCHING,
            "set it to false",
        ),
        ("policy.sequence_packing.enabled", packing, Capability.SEQUENCE_PACKING, "set it to false"),
        (
            "policy.logprob_chunk_size",
            policy.logprob_chunk_size is not None,
            Capability.CHUNKED_LOGPROBS,
            "remove it (null)",
        ),
    ]
    return [
        f"{path}: the '{spec.name}' training backend does not declare '{capability}'; {fix}"
        for path, on, capability, fix in wanted
        if on and not spec.supports(capability)
    ]


def lora_problems(policy: Any, spec: BackendSpec, generation_spec: BackendSpec | None, registry: Registry) -> list[str]:
    """``policy.lora`` needs a training backend declaring 'lora'; adapter refit an engine declaring 'lora_adapter'."""
    if not policy.lora.enabled:
        return []
    if not spec.supports(Capability.LORA):
        with_lora = sorted(
            r.name
            for r in registry.backends()
            if r.spec is not None and r.spec.kind == "training" and r.spec.supports(Capability.LORA)
        )
        return [
            f"policy.lora.enabled: the '{spec.name}' training backend does not train LoRA adapters "
            f"(no 'lora' capability); use one that does ({', '.join(with_lora) or 'none installed'}) or set "
            "policy.lora.enabled=false"
        ]
    if (
        policy.lora.refit == "adapter"
        and generation_spec is not None
        and generation_spec is not spec
        and not generation_spec.supports(Capability.LORA_ADAPTER)
    ):
        return [
            f"policy.lora.refit: 'adapter' needs a generation backend that applies LoRA adapters itself "
            f"('lora_adapter' capability), and '{generation_spec.name}' does not declare it; use "
            "policy.lora.refit=merged"
        ]
    return []


def hf_config_overrides_problems(
    policy: Any, generation_spec: BackendSpec | None, training_spec: BackendSpec
) -> list[str]:
    """``policy.hf_config_overrides`` must reach a separate engine too: its driver class has to take them.

    Checked before any process starts (the driver class is imported, nothing is built): an engine that
    ignored them would compute another model than the trainer's.
    """
    if not policy.hf_config_overrides or generation_spec is None or generation_spec is training_spec:
        return []
    driver_class = generation_spec.load_driver_class()
    if driver_class is None or "hf_config_overrides" in declared_kwargs(driver_class, {"hf_config_overrides": {}}):
        return []
    return [
        f"policy.hf_config_overrides: the generation backend '{generation_spec.name}' does not take it (its "
        "driver class declares no hf_config_overrides), so its engines would compute another model than the "
        "trainer's; remove the overrides or use a generation backend that applies them"
    ]
