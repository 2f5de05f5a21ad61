"""One resolution step: a loaded config and the installed plugins → what will run, decided once.

``rlcore run``, ``rlcore config validate``, ``train`` and ``Policy`` call
:func:`resolve` or :func:`resolve_policy`; ``build_run``, ``Policy``, the loops
and the workers consume the frozen result and never resolve or validate again.
The step:

1. a run's defaults: the default algorithm's section (``grpo``) when the config
   has no algorithm section, and, for an algorithm that generates, fsdp1 for
   training and generation when the default engine (vLLM) is not installed;
2. built-in model names (``tiny-llama``) become local paths;
3. the training backend's spec, its own section, its layout (tp, cp, pp; dp
   follows), its own config check, and the batch plan; a run packs when the
   backend can;
4. the generation backend's spec and section, and how it is refit;
5. the environment of a run whose algorithm generates: its spec and its
   ``env.<name>_cfg`` section;
6. the algorithm's own decisions (:meth:`rlcore.interfaces.algorithm.Algorithm.resolve`,
   reached through the registry): e.g. GRPO's asynchronous generation and the
   loss's automatic settings (the prev-logprob pass:
   :mod:`rlcore.algorithms.grpo.prev_logprobs`), distillation's teacher.

Every problem is one ConfigError line with its dotted path.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rlcore.config import backends
from rlcore.config.batch_plan import BatchPlan
from rlcore.config.coerce import as_policy_config
from rlcore.config.errors import ConfigError
from rlcore.config.generation import DEFAULT_GENERATION_BACKEND, GenerationConfig
from rlcore.config.policy import PolicyConfig
from rlcore.config.rules import check_rules
from rlcore.config.schemas import ClusterConfig, RLCoreConfig, load_algorithm, registered_algorithms
from rlcore.config.vision import vision_problems
from rlcore.models.builtin import resolve_builtin_policy
from rlcore.plugins import (
    BackendError,
    BackendSpec,
    Capability,
    EnvironmentSpec,
    LayoutRequest,
    ParallelLayout,
    Registry,
    get_registry,
)


@dataclass(frozen=True)
class ResolvedPolicy:
    """A policy as it runs: its config (model paths, packing decided), backend, section, layout, batch plan."""

    config: PolicyConfig
    spec: BackendSpec
    section: Any  # the backend's validated <name>_cfg section; None without a config class
    layout: ParallelLayout
    world_size: int
    use_gpu: bool
    batch: BatchPlan

    @property
    def data_parallel_size(self) -> int:
        return self.batch.data_parallel_size


@dataclass(frozen=True)
class ResolvedGeneration:
    """The generation backend of a run: its own engine (``separate``) or the training backend itself."""

    config: GenerationConfig
    spec: BackendSpec
    section: Any
    separate: bool  # an engine of its own (refit by the WeightSynchronizer), not the training backend
    colocated: bool  # a separate engine on the training workers' bundles
    adapter_refit: bool  # policy.lora.refit: adapter
    partial_refit: bool  # the engine loads part of the model (a LoRA policy sends only its adapted layers)
    verify_refit: bool = False  # policy.generation.verify_refit, decided: fingerprints compared after each refit


@dataclass(frozen=True)
class ResolvedEnvironment:
    """The environment of a run (a plugin's ``EnvironmentSpec``) and its validated section."""

    spec: EnvironmentSpec
    section: Any  # the validated env.<name>_cfg; None without a config class


@dataclass(frozen=True)
class ResolvedConfig:
    """Everything a config resolves to; ``config`` is the whole config with every decision written in."""

    config: RLCoreConfig
    policy: ResolvedPolicy
    generation: ResolvedGeneration | None
    async_generation: bool = False  # grpo.async_grpo.enabled and the engine can
    environment: ResolvedEnvironment | None = None  # a run's; None when only a policy was resolved
    notices: tuple[str, ...] = ()  # one line each: a default the run chose (fall-back, synchronous GRPO)
    teacher: ResolvedPolicy | None = None  # on-policy distillation's frozen teacher
    value_model: ResolvedPolicy | None = None  # a trained critic with a value head (PPO's), see Resolution
    policy_head: str = "lm"  # the policy's head: "value" for a reward model's training (see Resolution)


def resolve_policy(
    config: PolicyConfig | Mapping[str, Any],
    *,
    world_size: int,
    use_gpu: bool,
    registry: Registry | None = None,
    auto_packing: bool = False,
) -> ResolvedPolicy:
    """A policy config (the model, or the seed's plain dict) resolved for ``world_size`` ranks.

    A dict is validated with the cross-field rules, as a file would be. ``auto_packing``: a run packs
    when ``sequence_packing.enabled`` is null and the backend can; a Policy built directly does not.
    """
    registry = registry or get_registry()
    if not isinstance(config, PolicyConfig):
        config = as_policy_config(config)
        cluster = ClusterConfig(num_nodes=1, workers_per_node=world_size, use_gpu=use_gpu)
        if problems := check_rules(RLCoreConfig(cluster=cluster, policy=config)):
            raise ConfigError(problems)
    config = resolve_builtin_policy(config)
    spec, problems = backends.select(registry, config.training_backend, "training", backends.selection_path(config))
    if spec is None:
        raise ConfigError(problems)
    section = backends.own_section(spec, config, "policy")
    packing = config.sequence_packing.enabled
    if packing is None:
        packing = auto_packing and spec.supports(Capability.SEQUENCE_PACKING) and not config.dynamic_batching.enabled
        config = config.model_copy(
            update={"sequence_packing": config.sequence_packing.model_copy(update={"enabled": packing})}
        )
    request = LayoutRequest(config, section, world_size, use_gpu)
    layout = backends.layout_of(spec, request)
    batch = BatchPlan.of(config, world_size // layout.model_parallel_size, packing)
    problems = backends.capability_problems(config, spec, packing) + batch.problems()
    problems = backends.first_per_path(problems + backends.check_problems(spec, request))
    if problems:
        raise ConfigError(problems)
    return ResolvedPolicy(config, spec, section, layout, world_size, use_gpu, batch)


def resolve(cfg: RLCoreConfig, *, run: bool = False, registry: Registry | None = None) -> ResolvedConfig:
    """Resolve a loaded config (see the module docstring); ``run``: with ``rlcore run``'s defaults."""
    from rlcore.config.warm_start import with_warm_start

    registry = registry or get_registry()
    notices: list[str] = []
    cfg = with_warm_start(cfg, notices)
    if run:
        cfg = _run_defaults(cfg, registry, notices)
    problems = backends.other_sections(cfg.policy, "policy", registry, cfg.policy.training_backend)
    gen = cfg.policy.generation
    if gen is not None:
        problems += backends.other_sections(gen, "policy.generation", registry, gen.backend)
    try:
        policy = resolve_policy(
            cfg.policy, world_size=cfg.world_size, use_gpu=cfg.cluster.use_gpu, registry=registry, auto_packing=run
        )
    except ConfigError as exc:
        raise ConfigError(problems + exc.problems) from None
    generation = None
    if gen is not None:
        generation, gen_problems = _resolve_generation(policy, registry)
        problems += gen_problems
    problems += backends.lora_problems(policy.config, policy.spec, generation and generation.spec, registry)
    problems += backends.hf_config_overrides_problems(policy.config, generation and generation.spec, policy.spec)
    problems += vision_problems(policy.config, policy.spec, generation and generation.spec, registry)
    async_generation, environment, teacher, value_model, policy_head = False, None, None, None, "lm"
    algorithm = load_algorithm(cfg.algorithm, registry) if run else None
    if algorithm is not None and algorithm.generates:  # it generates and scores
        environment, env_problems = _resolve_environment(cfg, registry)
        problems += env_problems
    if algorithm is not None and not problems:
        decided = algorithm.resolve(cfg, policy, generation, registry, notices)
        cfg, problems, async_generation, teacher, value_model, policy_head = (
            decided.config,
            decided.problems,
            decided.async_generation,
            decided.teacher,
            decided.value_model,
            decided.policy_head,
        )
    if problems:
        raise ConfigError(problems)
    cfg = cfg.model_copy(update={"policy": policy.config})
    return ResolvedConfig(
        cfg, policy, generation, async_generation, environment, tuple(notices), teacher, value_model, policy_head
    )


# -- a run's defaults --------------------------------------------------------------------------------


def _run_defaults(cfg: RLCoreConfig, registry: Registry, notices: list[str]) -> RLCoreConfig:
    """A run of an algorithm that generates always has its section (the default algorithm's may be left out) and
    a generation backend (fsdp1 when vLLM is not installed); one that trains on data as written has neither."""
    spec = registered_algorithms(registry)[cfg.algorithm]
    if not spec.generates:
        return cfg
    if cfg.algorithm_section is None:
        cfg = cfg.model_copy(update={cfg.algorithm: spec.load_config_class()()})
        if problems := check_rules(cfg):
            raise ConfigError(problems)
    gen = cfg.policy.generation
    if gen is None:
        raise ConfigError(["policy.generation: rlcore run needs a generation section (e.g. {backend: vllm})"])
    if gen.backend != DEFAULT_GENERATION_BACKEND or gen.backend == cfg.policy.training_backend:
        return cfg  # only the default engine falls back; anything else is resolved as configured
    try:
        registry.resolve(gen.backend, kind="generation")
        return cfg
    except BackendError as exc:
        fallback = backends.self_generating(registry, cfg.policy.training_backend)
        if fallback is None:
            return cfg  # nothing to fall back to: resolution reports the original problem
        notices.append(f"notice: {exc}; falling back to {fallback} for training and generation")
    policy = cfg.policy.model_copy(
        update={"backend": fallback, "generation": gen.model_copy(update={"backend": fallback})}
    )
    return cfg.model_copy(update={"policy": policy})


def _resolve_generation(policy: ResolvedPolicy, registry: Registry) -> tuple[ResolvedGeneration | None, list[str]]:
    gen = policy.config.generation
    separate = gen.backend != policy.config.training_backend
    if not separate:
        if not policy.spec.supports(Capability.GENERATE):
            return None, [
                f"policy.generation.backend: training backend '{gen.backend}' cannot generate; use a "
                "generation backend such as 'vllm'"
            ]
        if gen.verify_refit:
            return None, [
                "policy.generation.verify_refit: is true, but the training backend generates itself and "
                "no refit happens; remove it, or set policy.generation.backend to an engine (e.g. vllm)"
            ]
        return ResolvedGeneration(gen, policy.spec, None, False, False, False, False), []
    spec, problems = backends.select(registry, gen.backend, "generation", "policy.generation.backend")
    if spec is None:
        return None, problems
    try:
        section = backends.own_section(spec, gen, "policy.generation")
    except ConfigError as exc:
        return None, exc.problems
    verifiable = spec.supports(Capability.VERIFIED_REFIT)
    if gen.verify_refit and not verifiable:
        return None, [
            f"policy.generation.verify_refit: is true, but generation backend '{spec.name}' does not "
            "declare the verified_refit capability (rlcore backends list shows it); set it to null or "
            "false, or use a backend that declares it (e.g. vllm)"
        ]
    lora = policy.config.lora
    return ResolvedGeneration(
        gen,
        spec,
        section,
        separate=True,
        colocated=gen.colocated.enabled,
        adapter_refit=lora.enabled and lora.refit == "adapter",
        partial_refit=spec.supports(Capability.PARTIAL_REFIT),
        verify_refit=verifiable if gen.verify_refit is None else gen.verify_refit,
    ), []


def _resolve_environment(cfg: RLCoreConfig, registry: Registry) -> tuple[ResolvedEnvironment | None, list[str]]:
    spec, problems = backends.select(registry, cfg.env.name, "environment", "env.name")
    if spec is None:
        return None, problems
    others = [
        f"env.{key}: the environment is '{spec.name}', which reads env.{spec.name}_cfg; remove it"
        for key in cfg.env.backend_sections
        if key != f"{spec.name}_cfg"
    ]
    if spec.config_class is None and cfg.env.backend_sections.get(f"{spec.name}_cfg"):
        others.append(f"env.{spec.name}_cfg: the '{spec.name}' environment takes no settings; remove them")
    try:
        return ResolvedEnvironment(spec, backends.own_section(spec, cfg.env, "env")), others
    except ConfigError as exc:
        return None, others + exc.problems
