"""The backends a config selects, checked against the installed plugins: their specs, their own
``<name>_cfg`` sections, their layout, and the capabilities the config needs from them.

Each function returns problem lines (``<dotted path>: <what is wrong>; <the fix>``) or raises
:class:`~rlcore.config.ConfigError`; :func:`rlcore.config.resolve` collects them.
"""

from __future__ import annotations

import difflib
from typing import Any

from rlcore.config.errors import ConfigError
from rlcore.config.loader import validate_section
from rlcore.plugins import BackendError, BackendSpec, Capability, LayoutRequest, ParallelLayout, Registry
from rlcore.plugins.layout import DATA_PARALLEL


def select(registry: Registry, name: str, kind: str, path: str) -> tuple[BackendSpec | None, list[str]]:
    """The ``ok`` spec of backend ``name``, or None and the problem (named by the config ``path``)."""
    try:
        return registry.resolve(name, kind=kind), []
    except BackendError as exc:
        return None, [f"{path}: {exc}"]


def own_section(spec: BackendSpec, owner: Any, path: str) -> Any:
    """The backend's own ``<name>_cfg`` section of ``owner`` (the policy or the generation config at
    ``path``), validated with its ``config_class``; None without a config class, the defaults when absent.

    Raises ConfigError (dotted path, one line per problem).
    """
    key = f"{spec.name}_cfg"
    try:
        model = spec.load_config_class()
    except Exception as exc:  # noqa: BLE001 - a plugin's import error, reported as a config problem
        raise ConfigError([f"{path}.{key}: cannot import config class {spec.config_class}: {exc}"]) from exc
    if model is None:
        return None
    if isinstance(getattr(owner, key, None), model):
        return getattr(owner, key)  # a section the core schema declares (dtensor_cfg): validated already
    section = (getattr(owner, "backend_sections", None) or {}).get(key, {})
    validated, problems = validate_section(model, section, f"{path}.{key}")
    if validated is None:
        raise ConfigError(problems)
    return validated


def unknown_sections(owner: Any, path: str, registry: Registry) -> list[str]:
    """``*_cfg`` sections under ``path`` that name no installed backend."""
    known = sorted({r.name for r in registry.records if r.spec is not None})
    problems = []
    for key in getattr(owner, "backend_sections", None) or {}:
        backend = key[: -len("_cfg")]
        if backend not in known:
            close = difflib.get_close_matches(backend, known, n=1)
            hint = f"; did you mean '{close[0]}_cfg'?" if close else ""
            problems.append(f"{path}.{key}: no installed backend named '{backend}'{hint}")
    return problems


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
        raise ConfigError([f"policy: the layout function {spec.layout} of backend '{spec.name}' returned "
                           f"{type(layout).__name__}, not a rlcore.plugins.ParallelLayout"])
    world, size = request.world_size, layout.model_parallel_size
    if world % size:
        raise ConfigError([f"{', '.join(layout.setting_paths())}: {layout.describe()} does not divide the world "
                           f"size {world} (cluster.num_nodes × cluster.workers_per_node); choose sizes whose product "
                           f"divides {world}, or a cluster of a multiple of {size} ranks"])
    return layout


def check_problems(spec: BackendSpec, request: LayoutRequest) -> list[str]:
    """What the backend's own config check says of ``request`` (nothing without one)."""
    function = spec.load_config_check()
    if function is None:
        return []
    problems = function(request)
    if not isinstance(problems, (list, tuple)) or not all(isinstance(p, str) for p in problems):
        return [f"policy: the config check {spec.config_check} of backend '{spec.name}' returned "
                f"{type(problems).__name__}, not a list of problem lines"]
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
    wanted = [("policy.dynamic_batching.enabled", policy.dynamic_batching.enabled, Capability.DYNAMIC_BATCHING,
               "set it to false"),
              ("policy.sequence_packing.enabled", packing, Capability.SEQUENCE_PACKING, "set it to false"),
              ("policy.logprob_chunk_size", policy.logprob_chunk_size is not None, Capability.CHUNKED_LOGPROBS,
               "remove it (null)")]
    return [f"{path}: the '{spec.name}' training backend does not declare '{capability}'; {fix}"
            for path, on, capability, fix in wanted if on and not spec.supports(capability)]


def lora_problems(policy: Any, spec: BackendSpec, generation_spec: BackendSpec | None,
                  registry: Registry) -> list[str]:
    """``policy.lora`` needs a training backend declaring 'lora'; adapter refit an engine declaring 'lora_adapter'."""
    if not policy.lora.enabled:
        return []
    if not spec.supports(Capability.LORA):
        with_lora = sorted(r.name for r in registry.records if r.spec is not None and r.spec.kind == "training"
                           and r.spec.supports(Capability.LORA))
        return [f"policy.lora.enabled: the '{spec.name}' training backend does not train LoRA adapters "
                f"(no 'lora' capability); use one that does ({', '.join(with_lora) or 'none installed'}) or set "
                "policy.lora.enabled=false"]
    if policy.lora.refit == "adapter" and generation_spec is not None and generation_spec is not spec \
            and not generation_spec.supports(Capability.LORA_ADAPTER):
        return [f"policy.lora.refit: 'adapter' needs a generation backend that applies LoRA adapters itself "
                f"('lora_adapter' capability), and '{generation_spec.name}' does not declare it; use "
                "policy.lora.refit=merged"]
    return []
