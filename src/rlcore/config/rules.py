"""Cross-field rules, checked once the schema has validated.

Each rule takes a validated ``RLCoreConfig`` and yields problem lines that
name the dotted path(s), the bad value(s) and the fix. Adding a rule is
writing one function and decorating it with ``@rule``. The rules here are the
core's; an algorithm's own rules live in its package and are reached through
the registry (its spec's ``rules``: :func:`algorithms_own_rules`). The rules
that read an algorithm's section read only its schedule
(:class:`rlcore.config.schedule.LoopSchedule`) and skip a section without one.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from rlcore.config.data import max_input_problem
from rlcore.config.policy import ONLY_READ_BY, SchedulerMilestones
from rlcore.config.schedule import schedule_of

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
def max_input_fits_the_sequence(cfg: RLCoreConfig) -> Iterator[str]:
    """``data.max_input_seq_length`` is at most ``policy.max_total_sequence_length``, and a cut prompt fits."""
    if problem := max_input_problem(cfg):
        yield problem


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
        given = name in cfg.model_fields_set or name in cfg.owned_sections
        if given and getattr(cfg, name) is not None and getattr(cfg, name) != cfg.section_default(name):
            yield f"{name}: the config trains {algo}, so nothing reads {why}; remove {name} (or {algo})"
    if not spec.generates and cfg.policy.generation is not None:
        yield f"policy.generation: {algo} does not generate; remove the section (or {algo})"


@rule
def validation_and_epochs_need_their_data(cfg: RLCoreConfig) -> Iterator[str]:
    """Validation settings need validation samples, and epochs need a dataset; otherwise they would do nothing."""
    g, name = schedule_of(cfg.algorithm_section), cfg.algorithm
    if g is None:
        return  # no section yet (the default algorithm's), or one without a schedule
    asked = [f"{name}.{k}" for k in ("val_period", "val_at_start", "val_at_end") if getattr(g, k)]
    if asked and cfg.data.validation is None and not cfg.data.split_validation_size:
        yield (
            f"{', '.join(asked)}: there is nothing to validate on; set data.validation.path (a file of "
            "samples) or data.split_validation_size, or turn validation off"
        )
    # a default (sft's 1) suits a generator: only epochs the config asks for are refused
    given = getattr(g, "model_fields_set", {"max_num_epochs"})
    if g.max_num_epochs is not None and "max_num_epochs" in given and cfg.data.train.generator is not None:
        yield (
            f"{name}.max_num_epochs: the train data is a generator, which has no epochs; set data.train.path or "
            f"remove max_num_epochs ({name}.max_num_steps bounds the run)"
        )


@rule
def checkpoint_metric_is_there_when_saving(cfg: RLCoreConfig) -> Iterator[str]:
    """A validation metric exists only on validated steps: never measured is an error; measured on some saved
    steps only is NeMo-RL's warning (the others stay out of the top-k)."""
    ck, g, name = cfg.checkpointing, schedule_of(cfg.algorithm_section), cfg.algorithm
    if not ck.enabled or ck.metric_name is None or not ck.metric_name.startswith("validation/") or g is None:
        return  # nothing saved, nothing ranked
    if g.val_period == 0:
        yield (
            f"checkpointing.metric_name: {ck.metric_name} is never measured, as {name}.val_period is 0 (no "
            f"periodic validation); set {name}.val_period to a divisor of checkpointing.save_every_n_steps="
            f"{ck.save_every_n_steps}, or checkpointing.metric_name=null to keep the newest checkpoints"
        )
    elif ck.save_every_n_steps % g.val_period:
        _warn_unranked_checkpoints(ck.metric_name, name, g.val_period, ck.save_every_n_steps)


def _warn_unranked_checkpoints(metric: str, algorithm: str, val_period: int, save_period: int) -> None:
    """NeMo-RL accepts a save period that is not a multiple of the validation period and warns: a checkpoint of a
    step without validation records no metric and stays out of the top-k (rlcore.run.checkpoints.kept ranks it
    last, as NeMo-RL's CheckpointManager sorts it), though the newest checkpoint is always kept."""
    import warnings

    warnings.warn(
        f"checkpointing.metric_name: {metric} is measured every {algorithm}.val_period={val_period} steps, but "
        f"checkpoints are saved every checkpointing.save_every_n_steps={save_period}: a checkpoint of a step "
        "without validation records no metric and is kept out of the top-k (the newest is kept regardless); make "
        "the save period a multiple of the validation period to rank every checkpoint",
        UserWarning,
        stacklevel=2,
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
def one_starting_model(cfg: RLCoreConfig) -> Iterator[str]:
    policy = cfg.policy
    if policy.warm_start is not None and "model_name" in policy.model_fields_set:
        yield (
            f"policy.warm_start: {policy.warm_start!r} gives the starting model (its last checkpoint), and "
            f"policy.model_name {policy.model_name!r} names another; remove one of them"
        )


@rule
def algorithms_own_rules(cfg: RLCoreConfig) -> Iterator[str]:
    """Each algorithm's own rules (its spec's ``rules``), run when the config trains it or sets a top-level
    section it owns (GRPO's rules also judge ``loss`` in a config that trains SFT, as that section is GRPO's)."""
    from rlcore.config.schemas import registered_algorithms

    for name, spec in registered_algorithms().items():
        if spec.rules is None or spec.missing_requirements():
            continue
        if name != cfg.algorithm and not set(spec.sections) & set(cfg.owned_sections):
            continue
        try:
            check = spec.load_rules()
        except Exception as exc:  # noqa: BLE001 - a plugin's import error, reported as a config problem
            yield f"{name}: cannot import the rules {spec.rules}: {exc}"
            continue
        yield from check(cfg)
