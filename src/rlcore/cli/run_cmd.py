"""``rlcore run``: the GRPO loop from a config, on a private local Ray by default."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Optional

import typer

from rlcore.cli.config_source import ConfigSource, NemoOverridesArg, SourceOpt, echo_ignored, load_cli_config


def _fail(lines: list[str]) -> None:
    for line in lines:
        typer.echo(line, err=True)
    raise typer.Exit(1)


def _fall_back_to_fsdp1(cfg: Any) -> Any:
    """Without rl-vllm installed, train and generate with fsdp1 instead (with a one-line notice)."""
    from rlcore.plugins import BackendError, get_registry

    gen = cfg.policy.generation
    registry = get_registry()
    if gen.backend != "vllm" or gen.backend == cfg.policy.training_backend:
        return cfg  # only the default engine falls back; anything else is validated as configured
    try:
        registry.resolve(gen.backend, kind="generation")
        return cfg
    except BackendError as exc:
        try:
            registry.resolve("fsdp1", kind="training")
        except BackendError:
            return cfg  # nothing to fall back to: validation reports the original problem
        typer.echo(f"notice: {exc}; falling back to fsdp1 for training and generation", err=True)
    policy = cfg.policy.model_copy(update={"backend": "fsdp1", "generation": gen.model_copy(update={"backend": "fsdp1"})})
    return cfg.model_copy(update={"policy": policy})


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


def run(
    config: Optional[Path] = typer.Argument(None, help="YAML config; omitted = the embedded defaults."),
    override: list[str] = typer.Option([], "-o", "--override", help="Dotted override key=value (repeatable)."),
    resume: bool = typer.Option(False, "--resume", help="Continue from the latest checkpoint in the output dir "
                                "(an error when there is none)."),
    verbose: bool = typer.Option(False, "-v", "--verbose", help="Print full tracebacks, not only one line."),
    source: SourceOpt = ConfigSource.rlcore,
    nemo_overrides: NemoOverridesArg = None,
) -> None:
    """Train with GRPO. Fails before starting anything if the config, a backend or the model is wrong."""
    from rlcore.cli.run_control import StopOnSignals, StopRequested, one_line, write_traceback
    from rlcore.config import ConfigError
    from rlcore.models import resolve_builtin_models
    from rlcore.plugins.registry import validate_backend_sections
    from rlcore.preflight import check_model_sources

    try:
        loaded, ignored = load_cli_config(config, override, source, nemo_overrides)
        echo_ignored(ignored)
        cfg = resolve_builtin_models(with_grpo_defaults(loaded))
    except ConfigError as exc:
        _fail(exc.problems)
    if cfg.policy.generation is None:
        _fail(["policy.generation: rlcore run needs a generation section (e.g. {backend: vllm})"])
    cfg = _fall_back_to_fsdp1(cfg)
    problems = validate_backend_sections(cfg)
    if resume and (message := _nothing_to_resume(cfg)):
        problems.append(message)
    problems += check_model_sources(cfg)  # a missing or damaged model fails here, before Ray starts
    if problems:
        _fail(problems)
    log_dir = Path(cfg.logger.output_dir) / "logs"
    try:
        with StopOnSignals() as signals:
            summary = train(cfg, resume=resume, signals=signals)
    except StopRequested as stop:
        latest = _latest_checkpoint(cfg)
        typer.echo(f"stopped by {stop}: " + (f"resume from {latest} with --resume" if latest
                                              else "no checkpoint was written yet"), err=True)
        raise typer.Exit(stop.exit_code) from None
    except Exception as exc:  # noqa: BLE001 - every failure ends as one line (+ the log)
        path = write_traceback(exc, log_dir)
        if verbose:
            typer.echo(path.read_text(), err=True)
        typer.echo(f"error: {one_line(exc)}", err=True)
        typer.echo(f"(full traceback in {path}{'' if verbose else '; -v prints it'})", err=True)
        raise typer.Exit(1) from None
    typer.echo(json.dumps(summary))


def _latest_checkpoint(cfg: Any) -> Path | None:
    from rlcore.algorithms.run_checkpoint import latest_step

    latest = latest_step(Path(cfg.logger.output_dir) / "checkpoints")
    return latest[1] if latest else None


def _nothing_to_resume(cfg: Any) -> str | None:
    if _latest_checkpoint(cfg) is not None:
        return None
    where = Path(cfg.logger.output_dir) / "checkpoints"
    return (f"--resume: no complete checkpoint in {where} (checkpointing.enabled="
            f"{cfg.checkpointing.enabled}); run without --resume to start fresh")


def train(cfg: Any, resume: bool = False, signals: Any = None) -> dict[str, Any]:
    """Build the run, train, checkpoint; returns a summary (first/last mean reward, paths).

    ``resume``: continue after the newest complete checkpoint (``FileNotFoundError`` if there is none);
    ``metrics.jsonl`` keeps one row per step. ``signals`` (a ``StopOnSignals``) holds a stop until a
    checkpoint being written is complete.
    """
    from rlcore.algorithms.grpo import build_run, grpo_train
    from rlcore.algorithms.run_checkpoint import latest_step, save_step
    from rlcore.algorithms.run_log import MetricsLogger, keep_steps_before, read_metrics
    from rlcore.models import resolve_builtin_models

    cfg = resolve_builtin_models(with_grpo_defaults(cfg))
    out = Path(cfg.logger.output_dir)
    ckpt_root = out / "checkpoints"
    resume_from = latest_step(ckpt_root) if resume else None
    if resume and resume_from is None:
        raise FileNotFoundError(_nothing_to_resume(cfg))
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
