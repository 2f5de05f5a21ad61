"""Cross-field rules, checked once the schema has validated.

Each rule takes a validated ``RLCoreConfig`` and yields problem lines that
name the dotted path(s), the bad value(s) and the fix. Adding a rule is
writing one function and decorating it with ``@rule``.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from rlcore.config.grpo import TOKEN_LEVEL_ESTIMATORS
from rlcore.config.policy import ONLY_READ_BY, SchedulerMilestones

if TYPE_CHECKING:
    from rlcore.config.schemas import RLCoreConfig

Rule = Callable[["RLCoreConfig"], Iterable[str]]
RULES: list[Rule] = []


def rule(fn: Rule) -> Rule:
    """Register ``fn`` as a cross-field rule."""
    RULES.append(fn)
    return fn


def check_rules(cfg: RLCoreConfig) -> list[str]:
    """Run every registered rule; returns all problem lines (empty when fine)."""
    return [line for fn in RULES for line in fn(cfg)]


@rule
def one_training_backend(cfg: RLCoreConfig) -> Iterator[str]:
    """At most one ``policy.<backend>_cfg`` section is on (see ``PolicyConfig.enabled_sections``)."""
    on = cfg.policy.enabled_sections
    if len(on) < 2:
        return
    paths = ", ".join(f"policy.{name}_cfg.enabled" for name in on)
    if len(on) == 2:
        a, b = on
        yield (
            f"{paths}: both are true; enable one training backend: set policy.{b}_cfg.enabled=false to train "
            f"with {a}, or policy.{a}_cfg.enabled=false to train with {b}"
        )
    else:
        yield f"{paths}: all are true; enable one training backend: set enabled=false on all but one"


@rule
def batching_modes_exclusive(cfg: RLCoreConfig) -> Iterator[str]:
    p = cfg.policy
    if p.dynamic_batching.enabled and p.sequence_packing.enabled:
        yield (
            "policy.dynamic_batching.enabled, policy.sequence_packing.enabled: both are true; they are mutually "
            "exclusive: set one of them to false"
        )


@rule
def scheduler_milestones_fit(cfg: RLCoreConfig) -> Iterator[str]:
    entries = cfg.policy.scheduler or []
    marks = [(i, e) for i, e in enumerate(entries) if isinstance(e, SchedulerMilestones)]
    n_sched = len(entries) - len(marks)
    if len(marks) > 1:
        yield (f"policy.scheduler: has {len(marks)} 'milestones' entries; keep exactly one to chain the schedulers")
        return
    if not marks:
        if n_sched > 1:
            yield (
                f"policy.scheduler: has {n_sched} schedulers but no {{name: milestones, milestones: [...]}} "
                "entry; add one with the step at which each next scheduler starts"
            )
        return
    i, m = marks[0]
    path = f"policy.scheduler[{i}].milestones"
    if len(m.milestones) != n_sched - 1:
        yield (
            f"{path}: has {len(m.milestones)} entries for {n_sched} schedulers; SequentialLR needs one milestone "
            f"fewer than schedulers ({max(n_sched - 1, 0)})"
        )
    elif any(b <= a for a, b in zip(m.milestones, m.milestones[1:])):
        yield f"{path}: {m.milestones} must be strictly increasing steps"


@rule
def separate_generation_has_resources(cfg: RLCoreConfig) -> Iterator[str]:
    gen = cfg.policy.generation
    if gen is not None and not gen.colocated.enabled and gen.colocated.resources is None:
        yield (
            "policy.generation.colocated.resources: is missing while policy.generation.colocated.enabled is "
            "false; give generation its own resources: {num_nodes: 1, workers_per_node: 1}, or set "
            "colocated.enabled=true"
        )


@rule
def async_grpo_needs_its_own_engine(cfg: RLCoreConfig) -> Iterator[str]:
    """Async GRPO overlaps a separate engine with training: it needs its own resources, and importance weights
    to correct for rollouts from older weights (as NeMo-RL requires)."""
    if cfg.grpo is None or not cfg.grpo.async_grpo.enabled:
        return
    gen, p = cfg.policy.generation, cfg.policy
    if gen is not None and gen.backend != p.training_backend and gen.colocated.enabled:
        yield (
            "grpo.async_grpo.enabled: generation can run ahead of training only on its own resources, but "
            "policy.generation.colocated.enabled is true; set it to false and give "
            "policy.generation.colocated.resources (e.g. {num_nodes: 1, workers_per_node: 1})"
        )
    if not cfg.loss.use_importance_sampling_correction:
        yield (
            "loss.use_importance_sampling_correction: async GRPO trains on rollouts sampled with older "
            "weights, which the importance weights correct for; set it to true"
        )


@rule
def rollout_batch_fits_training(cfg: RLCoreConfig) -> Iterator[str]:
    g, p = cfg.grpo, cfg.policy
    if g is None:
        return
    rollout = g.num_prompts_per_step * g.num_generations_per_prompt
    if rollout % p.train_global_batch_size:
        yield (
            f"grpo.num_prompts_per_step × grpo.num_generations_per_prompt = {g.num_prompts_per_step} × "
            f"{g.num_generations_per_prompt} = {rollout} is not a multiple of policy.train_global_batch_size "
            f"{p.train_global_batch_size}: each step trains on whole global batches; change one of them"
        )
    if cfg.loss.force_on_policy_ratio is True and rollout != p.train_global_batch_size:
        yield (
            f"loss.force_on_policy_ratio needs each rollout trained in one optimizer step, but the rollout "
            f"batch {rollout} != policy.train_global_batch_size {p.train_global_batch_size}: set them equal, "
            "or set it to null (automatic: on only when they are equal) or false"
        )
    if g.advantage_estimator.startswith("leave_one_out") and g.num_generations_per_prompt < 2:
        yield (
            f"grpo.num_generations_per_prompt: {g.advantage_estimator} advantages need at least 2 completions "
            "per prompt; raise it or set grpo.advantage_estimator=mean_std"
        )


@rule
def kl_in_reward_needs_reinforce_plus_plus(cfg: RLCoreConfig) -> Iterator[str]:
    """The KL moves from the loss into the reward only where an estimator puts it there; elsewhere it would
    vanish (NeMo-RL drops it silently)."""
    loss = cfg.loss
    if not loss.use_kl_in_reward:
        return
    estimator = cfg.grpo.advantage_estimator if cfg.grpo is not None else None
    if estimator not in TOKEN_LEVEL_ESTIMATORS:
        yield (
            f"loss.use_kl_in_reward: only the Reinforce++ advantages put the KL into the reward, but "
            f"grpo.advantage_estimator is {estimator}; set it to reinforce_plus_plus[_baseline] or set "
            "use_kl_in_reward to false (KL in the loss)"
        )
    if loss.reference_policy_kl_penalty == 0:
        yield (
            "loss.use_kl_in_reward: the KL coefficient loss.reference_policy_kl_penalty is 0, so there is no "
            "KL to put into the reward; set a coefficient > 0 or set use_kl_in_reward to false"
        )
    if loss.force_on_policy_ratio is True:
        yield (
            "loss.force_on_policy_ratio: true skips the prev-logprob pass, but loss.use_kl_in_reward computes "
            "the reward's KL from those logprobs before training; set it to null (automatic) or false"
        )


@rule
def reward_transforms_not_with_async_grpo(cfg: RLCoreConfig) -> Iterator[str]:
    """NeMo-RL's async GRPO refuses dynamic sampling, reward scaling and reward shaping (examples/run_grpo.py)."""
    g = cfg.grpo
    if g is None or not g.async_grpo.enabled:
        return
    for path, on in (
        ("grpo.use_dynamic_sampling", g.use_dynamic_sampling),
        ("grpo.reward_scaling.enabled", g.reward_scaling.enabled),
        ("grpo.reward_shaping.enabled", g.reward_shaping.enabled),
    ):
        if on:
            yield (
                f"{path}: is true, but it is not supported with async GRPO (grpo.async_grpo.enabled), as in "
                f"NeMo-RL; set {path}=false or grpo.async_grpo.enabled=false"
            )


@rule
def batch_multiplier_only_with_dynamic_sampling(cfg: RLCoreConfig) -> Iterator[str]:
    """batch_multiplier only sizes dynamic sampling's generation batches (NeMo-RL asserts it is 1 without)."""
    g = cfg.grpo
    if g is not None and not g.use_dynamic_sampling and g.batch_multiplier != 1:
        yield (
            f"grpo.batch_multiplier: is {g.batch_multiplier}, but it only sizes the generation batches of "
            "dynamic sampling; set grpo.use_dynamic_sampling=true or grpo.batch_multiplier=1"
        )


@rule
def advantage_clip_bounds_around_zero(cfg: RLCoreConfig) -> Iterator[str]:
    """Advantages are centred on 0: a bound on the wrong side of 0 gives every advantage beyond it the same sign
    (NeMo-RL does not check; its docs describe symmetric bounds such as -100/100)."""
    g = cfg.grpo
    if g is None:
        return
    low, high = g.advantage_clip_low, g.advantage_clip_high
    if low is not None and high is not None and low > high:
        yield (
            f"grpo.advantage_clip_low, grpo.advantage_clip_high: {low} > {high}; the low bound must not exceed "
            "the high one"
        )
        return
    if low is not None and low > 0:
        yield (
            f"grpo.advantage_clip_low: is {low} > 0, so every advantage below it, all negative ones included, "
            f"would become +{low} (bad completions pushed up); set it <= 0 (e.g. -5) or null"
        )
    if high is not None and high < 0:
        yield (
            f"grpo.advantage_clip_high: is {high} < 0, so every advantage above it, all positive ones "
            f"included, would become {high} (good completions pushed down); set it >= 0 (e.g. 5) or null"
        )


@rule
def reward_scaling_range(cfg: RLCoreConfig) -> Iterator[str]:
    g = cfg.grpo
    if g is None or not g.reward_scaling.enabled:
        return
    sc = g.reward_scaling
    if sc.source_max <= sc.source_min:
        yield (
            f"grpo.reward_scaling.source_max: is {sc.source_max}, not above grpo.reward_scaling.source_min "
            f"{sc.source_min}; the source range must not be empty: set source_max > source_min"
        )


@rule
def reward_shaping_has_its_settings(cfg: RLCoreConfig) -> Iterator[str]:
    """DAPO's overlong penalty needs its three settings (NeMo-RL raises at the first step without them); the
    truncation penalty (stop_properly_penalty_coef) needs none of them."""
    g = cfg.grpo
    if g is None or not g.reward_shaping.enabled or g.reward_shaping.stop_properly_penalty_coef is not None:
        return
    sh = g.reward_shaping
    missing = [
        f"grpo.reward_shaping.{k}"
        for k in ("overlong_buffer_length", "overlong_buffer_penalty", "max_response_length")
        if getattr(sh, k) is None
    ]
    if missing:
        yield (
            f"{', '.join(missing)}: {'is' if len(missing) == 1 else 'are'} null, but DAPO's overlong penalty "
            "(grpo.reward_shaping.enabled without stop_properly_penalty_coef) needs it; set "
            f"{'it' if len(missing) == 1 else 'them'} (e.g. overlong_buffer_length: 128, "
            "overlong_buffer_penalty: 1, max_response_length: the longest completion), or set "
            "stop_properly_penalty_coef to penalize truncation instead"
        )
    elif sh.overlong_buffer_length > sh.max_response_length:  # type: ignore[operator]
        yield (
            f"grpo.reward_shaping.overlong_buffer_length: is {sh.overlong_buffer_length}, more than "
            f"grpo.reward_shaping.max_response_length {sh.max_response_length}, so even an empty completion "
            "would be penalized; make the buffer at most max_response_length"
        )


@rule
def one_algorithm_and_only_its_sections(cfg: RLCoreConfig) -> Iterator[str]:
    """A config trains one algorithm. The sections its spec says it does not read (SFT and DPO: the loss and the
    environment; distillation: the loss) would be ignored, so they are refused (a section at its defaults says
    nothing, e.g. one a dumped config writes); an algorithm that does not generate refuses policy.generation."""
    from rlcore.config.schemas import registered_algorithms

    chosen = sorted(cfg.algorithm_sections)
    if len(chosen) > 1:
        yield f"{', '.join(chosen)}: a config trains one algorithm; keep one of the sections"
    if not chosen:
        return
    algo = chosen[0]
    spec = registered_algorithms()[algo]
    for name, why in spec.unread_sections.items():
        value = getattr(cfg, name)
        default = type(cfg).model_fields[name].get_default(call_default_factory=True)
        if name in cfg.model_fields_set and value is not None and value != default:
            yield f"{name}: the config trains {algo}, so nothing reads {why}; remove {name} (or {algo})"
    if not spec.generates and cfg.policy.generation is not None:
        yield f"policy.generation: {algo} does not generate; remove the section (or {algo})"


@rule
def validation_and_epochs_need_their_data(cfg: RLCoreConfig) -> Iterator[str]:
    """Validation settings need validation samples, and epochs need a dataset; otherwise they would do nothing."""
    g, name = cfg.algorithm_section, cfg.algorithm
    if g is None:
        return
    asked = [f"{name}.{k}" for k in ("val_period", "val_at_start", "val_at_end") if getattr(g, k)]
    if asked and cfg.data.validation is None and not cfg.data.split_validation_size:
        yield (
            f"{', '.join(asked)}: there is nothing to validate on; set data.validation.path (a file of "
            "samples) or data.split_validation_size, or turn validation off"
        )
    # a default (sft's 1) suits a generator: only epochs the config asks for are refused
    if g.max_num_epochs is not None and "max_num_epochs" in g.model_fields_set and cfg.data.train.generator is not None:
        yield (
            f"{name}.max_num_epochs: the train data is a generator, which has no epochs; set data.train.path or "
            f"remove max_num_epochs ({name}.max_num_steps bounds the run)"
        )


@rule
def checkpoint_metric_is_there_when_saving(cfg: RLCoreConfig) -> Iterator[str]:
    """A validation metric exists only on validated steps: every checkpoint must be one, or it cannot rank."""
    ck, g, name = cfg.checkpointing, cfg.algorithm_section, cfg.algorithm
    if not ck.enabled or ck.metric_name is None or not ck.metric_name.startswith("validation/") or g is None:
        return  # nothing saved, nothing ranked
    if g.val_period == 0:
        yield (
            f"checkpointing.metric_name: {ck.metric_name} is never measured, as {name}.val_period is 0 (no "
            f"periodic validation); set {name}.val_period to a divisor of checkpointing.save_every_n_steps="
            f"{ck.save_every_n_steps}, or checkpointing.metric_name=null to keep the newest checkpoints"
        )
    elif ck.save_every_n_steps % g.val_period:
        yield (
            f"checkpointing.metric_name: {ck.metric_name} is measured every {name}.val_period={g.val_period} steps, "
            f"but checkpoints are saved every checkpointing.save_every_n_steps={ck.save_every_n_steps}; make "
            "the save period a multiple of the validation period"
        )


@rule
def single_backend_flags_need_their_backend(cfg: RLCoreConfig) -> Iterator[str]:
    """A ``policy`` field that only one training backend reads (marked ``ONLY_READ_BY``) is refused by the others."""
    p = cfg.policy
    backend = p.training_backend
    for name, field in type(p).model_fields.items():
        reader = (
            (field.json_schema_extra or {}).get(ONLY_READ_BY) if isinstance(field.json_schema_extra, dict) else None
        )
        if reader is not None and reader != backend and getattr(p, name) != field.default:
            yield (
                f"policy.{name}: is {str(getattr(p, name)).lower()} but the training backend is '{backend}', and "
                f"only {reader} reads it: set it to false (for {backend}: its own settings in "
                f"policy.{backend}_cfg, see docs/config-reference.md)"
            )


def _kwargs_problems(path: str, class_path: str, default_module: str, kwargs: dict, passed: str) -> Iterator[str]:
    from rlcore.config.signatures import init_signature

    sig = init_signature(class_path, default_module)
    if sig is None:
        return  # not readable from source: the worker's own call is the check
    for key in sig.unknown(list(kwargs)):
        if sig.names and key == sig.names[0]:
            yield f"{path}.{key}: is passed by rlcore ({passed}); remove it"
            continue
        close = difflib.get_close_matches(key, [n for n in sig.names[1:] if n not in sig.positional_only], n=1)
        hint = f"; did you mean '{close[0]}'?" if close else f"; it accepts {', '.join(sig.names[1:])}"
        yield f"{path}.{key}: not an argument of {class_path}{hint}"


@rule
def optimizer_and_scheduler_kwargs_exist(cfg: RLCoreConfig) -> Iterator[str]:
    p = cfg.policy
    yield from _kwargs_problems(
        "policy.optimizer.kwargs", p.optimizer.name, "torch.optim", p.optimizer.kwargs, "the model's parameters"
    )
    for i, entry in enumerate(p.scheduler or []):
        if isinstance(entry, SchedulerMilestones):
            continue
        yield from _kwargs_problems(
            f"policy.scheduler[{i}].kwargs", entry.name, "torch.optim.lr_scheduler", entry.kwargs, "the optimizer"
        )


@rule
def gdpo_settings_reach_gdpo(cfg: RLCoreConfig) -> Iterator[str]:
    """grpo.gdpo is read only by GDPO, and GDPO reads the reward components, which reward shaping does not touch
    (NeMo-RL shapes the total reward only, so under GDPO its penalties silently change nothing)."""
    g = cfg.grpo
    if g is None:
        return
    if g.advantage_estimator != "gdpo":
        default = type(g.gdpo)()
        changed = [f"grpo.gdpo.{k}" for k in type(g.gdpo).model_fields if getattr(g.gdpo, k) != getattr(default, k)]
        if changed:
            yield (
                f"{', '.join(changed)}: only GDPO reads {'it' if len(changed) == 1 else 'them'}, but "
                f"grpo.advantage_estimator is {g.advantage_estimator}; set grpo.advantage_estimator=gdpo or "
                f"remove {'it' if len(changed) == 1 else 'them'}"
            )
        return
    if g.reward_shaping.enabled:
        yield (
            "grpo.reward_shaping.enabled: is true, but GDPO's advantages come from the environment's reward "
            "components, which the shaping penalties do not touch (NeMo-RL shapes the total reward only); set "
            "it to false, or set grpo.advantage_estimator to a GRPO estimator (e.g. leave_one_out_std)"
        )
    if g.gdpo.use_leave_one_out_baseline and g.num_generations_per_prompt < 2:
        yield (
            "grpo.num_generations_per_prompt: GDPO with grpo.gdpo.use_leave_one_out_baseline needs at least 2 "
            "completions per prompt; raise it or set use_leave_one_out_baseline=false"
        )
