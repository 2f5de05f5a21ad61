"""A whole GRPO run from a validated config: build it, train, log metrics, checkpoint, and summarise.

``rlcore run`` (:mod:`rlcore.cli.run_cmd`) is a thin command around
:func:`train`: it loads the config, checks it and the model, and reports
errors; everything the run does happens here.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any


def with_grpo_defaults(cfg: Any) -> Any:
    """A run always has a ``grpo`` section: the defaults when the config leaves it out (rules re-checked)."""
    from rlcore.config import ConfigError, check_rules
    from rlcore.config.grpo import GRPOConfig

    if cfg.grpo is not None:
        return cfg
    cfg = cfg.model_copy(update={"grpo": GRPOConfig()})
    if problems := check_rules(cfg):
        raise ConfigError(problems)
    return cfg


def with_packing_default(cfg: Any) -> Any:
    """Resolve ``policy.sequence_packing.enabled: null``: a GRPO run packs its training and logprob passes
    when the training backend can and the config allows it (rules and the backend's own checks pass).

    A rollout's completions end at EOS with ragged lengths; packed, no micro-batch computes padding.
    """
    from rlcore.config import check_rules
    from rlcore.plugins import get_registry
    from rlcore.plugins.registry import validate_backend_sections

    packing = cfg.policy.sequence_packing
    if packing.enabled is not None:
        return cfg

    def with_packing(enabled: bool) -> Any:
        policy = cfg.policy.model_copy(update={"sequence_packing": packing.model_copy(update={"enabled": enabled})})
        return cfg.model_copy(update={"policy": policy})

    packed = with_packing(True)
    spec = get_registry().resolve(cfg.policy.training_backend, kind="training")
    can_pack = "sequence_packing" in spec.capabilities and not check_rules(packed) \
        and not validate_backend_sections(packed)
    return packed if can_pack else with_packing(False)


def checkpoint_root(cfg: Any) -> Path:
    """Where a run's step checkpoints go: ``<logger.output_dir>/checkpoints``."""
    return Path(cfg.logger.output_dir) / "checkpoints"


def latest_checkpoint(cfg: Any) -> Path | None:
    """The newest complete step checkpoint of the run ``cfg`` describes, or None."""
    from rlcore.run.checkpoints import latest_step

    latest = latest_step(checkpoint_root(cfg))
    return latest[1] if latest else None


def nothing_to_resume(cfg: Any) -> str | None:
    """Why ``--resume`` cannot continue this run (no complete checkpoint), or None when it can."""
    if latest_checkpoint(cfg) is not None:
        return None
    return (f"--resume: no complete checkpoint in {checkpoint_root(cfg)} (checkpointing.enabled="
            f"{cfg.checkpointing.enabled}); run without --resume to start fresh")


def train(cfg: Any, resume: bool = False, signals: Any = None, progress_file: Any = None) -> dict[str, Any]:
    """Build the run, train, checkpoint; returns a summary (first/last mean reward, paths).

    ``resume``: continue after the newest complete checkpoint (``FileNotFoundError`` if there is none);
    ``metrics.jsonl`` keeps one row per step. ``signals`` (a :class:`~rlcore.run.stopping.StopOnSignals`)
    holds a stop until a checkpoint being written is complete. ``progress_file``: where the progress bar
    goes (default standard error).
    """
    from rlcore.models import resolve_builtin_models
    from rlcore.run.build import build_run
    from rlcore.run.checkpoints import latest_step, save_step
    from rlcore.run.grpo import grpo_train
    from rlcore.run.metrics import MetricsLogger, keep_steps_before, read_metrics

    cfg = with_packing_default(resolve_builtin_models(with_grpo_defaults(cfg)))
    out = Path(cfg.logger.output_dir)
    ckpt_root = checkpoint_root(cfg)
    resume_from = latest_step(ckpt_root) if resume else None
    if resume and resume_from is None:
        raise FileNotFoundError(nothing_to_resume(cfg))
    start = resume_from[0] + 1 if resume_from else 0
    keep_steps_before(out / "metrics.jsonl", start)  # a fresh run starts a fresh log; a resumed one drops re-run steps
    run = build_run(cfg, resume_from[1] if resume_from else None, start)
    logger = None
    last = cfg.grpo.max_num_steps - 1
    hold = signals.hold if signals is not None else contextlib.nullcontext

    def on_step(step: int, metrics: dict[str, float]) -> None:
        logger.log(step, metrics)
        ck = cfg.checkpointing
        if ck.enabled and ((step + 1) % ck.save_every_n_steps == 0 or step == last):
            with hold():
                save_step(run.policy, ckpt_root, step, ck.keep_last)

    try:
        logger = MetricsLogger(out, tensorboard=cfg.logger.tensorboard, progress_bar=cfg.logger.progress_bar,
                               progress_file=progress_file,
                               total_steps=cfg.grpo.max_num_steps, initial_step=start)
        grpo_train(run, on_step)
    except BaseException:
        if logger is not None:
            with contextlib.suppress(Exception):  # the run's error is the one worth reporting
                logger.close()
        with contextlib.suppress(Exception):
            run.shutdown()
        raise
    png = logger.close()
    run.shutdown()
    rows = read_metrics(logger.path)
    latest = latest_step(ckpt_root)
    return {
        "steps": len({r["step"] for r in rows}),
        "first_reward_mean": rows[0]["reward_mean"] if rows else None,
        "last_reward_mean": rows[-1]["reward_mean"] if rows else None,
        "metrics": str(logger.path),
        "reward_curve": str(png) if png else None,
        "final_weights": str(latest[1] / "weights") if latest else None,
    }
