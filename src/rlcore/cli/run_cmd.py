"""``rlcore run``: the config's algorithm (GRPO by default) from a config, on a private local Ray by default.

The command loads the config and resolves it once against the installed
backends (:func:`rlcore.config.resolve`), runs the preflight (:func:`rlcore.preflight.preflight`, as
``rlcore config validate`` and ``rlcore doctor`` do) and the data, then hands the resolved config to
:func:`rlcore.run.train.train` and reports how the run ended.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import typer
from typer.core import TyperCommand

from rlcore.cli.config_source import (
    ConfigSource,
    NemoOverridesArg,
    SourceOpt,
    echo_ignored,
    load_cli_config,
    named_as_written,
)

# re-exported: the run's logic lives in rlcore.run
from rlcore.run.train import train


def installed_algorithms() -> str:
    """The algorithms a config can select here, from the registry (plugin modules only: no torch), for
    ``rlcore run --help``."""
    from rlcore.plugins import get_registry

    usable, unusable = [], []
    for record in get_registry().algorithms():
        origin = [] if record.distribution == "rlcore" else [f"from {record.distribution}"]
        if record.status != "ok":
            unusable.append(f"{record.name} ({record.status})")
        elif getattr(record.spec, "default", False):
            usable.insert(0, f"{record.name} ({', '.join(['the default', *origin])})")
        else:
            usable.append(record.name + (f" ({origin[0]})" if origin else ""))
    line = f"Installed algorithms: {', '.join(usable) or 'none'}"
    line += f"; found but not usable: {', '.join(unusable)}" if unusable else ""
    return line + " (rlcore algorithms list shows each with its status)."


class RunCommand(TyperCommand):
    """``rlcore run``, whose help lists the installed algorithms when it is shown (not when the CLI starts)."""

    def format_help(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        static = self.__dict__.setdefault("_static_help", (self.help or "").rstrip())
        self.help = f"{static}\n\n{installed_algorithms()}"
        super().format_help(ctx, formatter)


def _fail(lines: list[str]) -> None:
    for line in lines:
        typer.echo(line, err=True)
    raise typer.Exit(1)


def _summary_line(resolved: Any, data: Any, log_dir: Path, verbose: bool) -> str:
    """One line saying what is about to run (the algorithm's own description), and where its logs go."""
    from rlcore.config.schemas import load_algorithm

    cfg = resolved.config
    steps = data.num_steps(cfg.algorithm_section.max_num_steps)
    source = cfg.data.train.source or cfg.data.train.generator.rpartition(":")[2]
    p, c = cfg.policy, cfg.cluster
    where = "streamed here (-v)" if verbose else f"in {log_dir}/"
    workers = f"on {c.num_nodes}x{c.workers_per_node} {'GPU' if c.use_gpu else 'CPU'} workers, model {p.model_name}"
    return f"rlcore run: {load_algorithm(cfg.algorithm).describe(resolved, workers, source, steps)}; logs {where}"


def _run_warm_start(name: str, verbose: bool) -> None:
    """Run ``policy.warm_start`` to its end unless it has finished (resumed if it has checkpoints): the same
    command in a child process, in this one's process group, so a stop reaches both. Exit 1 if it fails."""
    import subprocess

    from rlcore.config.warm_start import finished_checkpoint, warm_start_file, warm_start_output
    from rlcore.run.checkpoints import complete_steps

    output = warm_start_output(name)
    if finished_checkpoint(output) is not None:
        return
    chain = os.environ.get(_WARM_START_CHAIN, "")
    file = str(warm_start_file(name).resolve())
    if file in chain.split(os.pathsep):
        _fail([f"error: policy.warm_start: {name!r} starts from itself (through {chain})"])
    resume = ["--resume"] if complete_steps(output / "checkpoints") else []
    typer.echo(f"policy.warm_start: running {name} first{' (resumed)' if resume else ''}, into {output}", err=True)
    command = [sys.executable, "-m", "rlcore", "run", name, *resume, *(["-v"] if verbose else [])]
    env = {**os.environ, _WARM_START_CHAIN: os.pathsep.join(filter(None, [chain, file]))}
    if subprocess.run(command, env=env).returncode != 0:
        _fail([f"error: policy.warm_start: {name!r} did not finish (its output is above); this run did not start"])


#: The configs of the warm starts being run, outermost first: a cycle of warm starts is refused.
_WARM_START_CHAIN = "RLCORE_WARM_START_CHAIN"


def _prepare(
    config: Path | None,
    override: list[str],
    resume: bool,
    source: ConfigSource,
    nemo_overrides: list[str] | None,
    verbose: bool = False,
) -> tuple[Any, Any, Any, Any]:
    """The config resolved and checked, its tokenizer, its data and the hold on its output directory
    (:class:`rlcore.run.ownership.OutputDirLock`, or None when the directory cannot be created), or one line per
    problem and exit 1: all before Ray starts and before anything is written."""
    from rlcore.config import ConfigError, resolve
    from rlcore.datasets import DataError
    from rlcore.distributed.startup_signals import signal_self_at
    from rlcore.preflight import preflight, problem_lines
    from rlcore.preflight.user_code import import_from_working_directory
    from rlcore.run.build import load_run_data
    from rlcore.run.ownership import OutputDirLock, OutputDirTaken
    from rlcore.run.prompts import load_tokenizer
    from rlcore.run.train import output_dir_problems, resume_refusals

    import_from_working_directory()  # the reward function of docs/tasks.md, ./my_task.py
    if config is None and source is ConfigSource.rlcore:
        from rlcore.examples import DEFAULT_EXAMPLE

        config = Path(DEFAULT_EXAMPLE)
    sources: dict[str, str] = {}  # --from nemo-rl: the NeMo-RL key of each rlcore key, named in the lines
    try:
        loaded, ignored = load_cli_config(config, override, source, nemo_overrides, sources)
        echo_ignored(ignored)
        if loaded.policy.warm_start is not None:
            _run_warm_start(loaded.policy.warm_start, verbose)
        resolved = resolve(loaded, run=True)
    except ConfigError as exc:
        _fail(named_as_written(exc.problems, sources))
    for notice in resolved.notices:
        typer.echo(notice, err=True)
    cfg = resolved.config
    # what `rlcore config validate` checks too (engines, CUDA, user code, files, models, hub), after the checkpoint
    refusals = resume_refusals(cfg) if resume else []  # a damaged or forged checkpoint too
    if problems := problem_lines(preflight(resolved, first=refusals, sources=sources)):
        _fail(problems)
    signal_self_at("prepare")  # a test hook (rlcore.distributed.startup_signals); nothing unless asked
    tokenizer = load_tokenizer(cfg)
    try:
        data = load_run_data(cfg, tokenizer)  # so does a bad row, a missing file or a prompt too long
    except DataError as exc:
        _fail([f"error: {exc}"])
    try:  # from here until the run ends, a second run into the same directory is refused
        hold = OutputDirLock(Path(cfg.logger.output_dir))
    except OutputDirTaken as exc:
        _fail([str(exc)])
    except OSError:
        hold = None  # it cannot be created: output_dir_problems says why
    if problems := output_dir_problems(cfg, resume):  # another run's results, or unwritable (created here, last)
        if hold is not None:
            hold.release()
        _fail(problems)
    return resolved, data, tokenizer, hold


def run(
    config: Path | None = typer.Argument(
        None,
        help="YAML config, or a shipped example's name (rlcore examples "
        "list); omitted = grpo_tiny, the tiny GRPO demo.",
    ),
    override: list[str] = typer.Option([], "-o", "--override", help="Dotted override key=value (repeatable)."),
    resume: bool = typer.Option(
        False, "--resume", help="Continue from the latest checkpoint in the output dir (an error when there is none)."
    ),
    verbose: bool = typer.Option(
        False,
        "-v",
        "--verbose",
        help="Stream every process's output (Ray, workers, "
        "engines) instead of logging it to <output_dir>/logs/, and print full tracebacks.",
    ),
    source: SourceOpt = ConfigSource.rlcore,
    nemo_overrides: NemoOverridesArg = None,
) -> None:
    """Train with the algorithm the config selects: the one whose section it has (sft:, dpo:, ...), or the
    default one when it has none. Fails before starting anything if the config, a backend or the model is wrong."""
    from rlcore.cli.errors import full_disk_line, one_line, write_traceback
    from rlcore.run.output import quiet_output, run_log_dir
    from rlcore.run.stopping import StopOnSignals
    from rlcore.run.train import resume_line

    line = StopLine(os.dup(2))  # a stop's one line, said once, on the terminal whatever became of stderr
    before = "stopped by {stop} before the run started: no checkpoint was written"
    early = StopOnSignals(force=line.forced(lambda stop: before.format(stop=stop)))
    try:
        with early:
            resolved, data, tokenizer, hold = _prepare(config, override, resume, source, nemo_overrides, verbose)
    except BaseException as exc:  # noqa: BLE001 - a stop, or what a stop inside an import turned into
        if (stop := early.stop_behind(exc)) is None:
            if (full := full_disk_line(exc)) is not None:  # before anything of the run is written
                typer.echo(f"error: {full}", err=True)
                raise typer.Exit(1) from None
            raise
        line.say(before.format(stop=stop))
        raise typer.Exit(stop.exit_code) from None
    cfg = resolved.config
    log_dir = run_log_dir(cfg.logger.output_dir)
    if resume:
        typer.echo(resume_line(cfg), err=True)
    typer.echo(_summary_line(resolved, data, log_dir, verbose), err=True)
    signals = StopOnSignals(force=line.forced(lambda stop: _stopped_line(stop, cfg)))
    try:
        with hold or contextlib.nullcontext(), quiet_output(log_dir, verbose) as terminal, signals:
            summary = train(
                resolved, resume=resume, signals=signals, progress_file=terminal, data=data, tokenizer=tokenizer
            )
    except BaseException as exc:  # noqa: BLE001 - a stop or a failure, each ends as one line
        if (stop := signals.stop_behind(exc)) is not None:
            line.say(_stopped_line(stop, cfg))
            raise typer.Exit(stop.exit_code) from None
        if not isinstance(exc, Exception):
            raise
        path = write_traceback(exc, log_dir)  # in the temporary directory when log_dir cannot be written
        if verbose and path is not None:
            typer.echo(path.read_text(), err=True)
        typer.echo(f"error: {one_line(exc)}", err=True)
        where = "" if path is None or path.parent == log_dir else f", as {log_dir} cannot be written"
        typer.echo(
            f"(full traceback in {path}{where}{'' if verbose else '; -v prints it'})"
            if path
            else f"(no traceback file: neither {log_dir} nor {tempfile.gettempdir()} can be written)",
            err=True,
        )
        raise typer.Exit(1) from None
    typer.echo(json.dumps(summary))


def _stopped_line(stop: Any, cfg: Any) -> str:
    """``stopped by SIGTERM: resume from <checkpoint> with --resume`` (or that none was written yet)."""
    from rlcore.run.train import latest_checkpoint

    latest = latest_checkpoint(cfg)
    return f"stopped by {stop}: " + (
        f"resume from {latest} with --resume" if latest else "no checkpoint was written yet"
    )


class StopLine:
    """The one line a stopped run says, said once: by the main thread when the stop ends gracefully, or by
    :class:`~rlcore.run.stopping.StopOnSignals`' watchdog thread when it is forced, whichever comes first."""

    def __init__(self, terminal_fd: int) -> None:
        self._terminal_fd = terminal_fd
        self._lock = threading.Lock()
        self._said = False

    def say(self, text: str) -> None:
        with self._lock:
            if not self._said:
                self._said = True
                os.write(self._terminal_fd, (text + "\n").encode())

    def forced(self, text: Callable[[Any], str]) -> Callable[[Any], None]:
        """What a stop that outlived its deadline does: say the line (unless said), hand the private Ray to its
        reaper without waiting on Ray or on the reaper, and end the process with the signal's exit code. The
        checkpoints on disk are whole: each is published by a rename, and one being written was let finish
        (or a second signal gave it up)."""

        def force(stop: Any) -> None:
            from rlcore.distributed.ray_runtime import abandon_private_ray

            try:
                self.say(text(stop))
                abandon_private_ray(timeout_s=None)
            finally:
                os._exit(stop.exit_code)

        return force


__all__ = ["run", "train"]
