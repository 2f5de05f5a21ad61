"""A whole run of the config's algorithm (GRPO, SFT, DPO, distillation, a third party's) from a resolved
config: build it, train, log metrics, checkpoint, and summarise. The algorithm is reached through the registry
(:func:`rlcore.config.schemas.load_algorithm`), never by its name.

``rlcore run`` (:mod:`rlcore.cli.run_cmd`) is a thin command around
:func:`train`: it loads and resolves the config, checks the model, and reports
errors; everything the run does happens here.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rlcore.config import ResolvedConfig, resolve
from rlcore.config.warm_start import RUN_SUMMARY
from rlcore.run.checkpoints import checkpoint_root
from rlcore.run.output import run_log_dir
from rlcore.run.step import loop_setting


def latest_checkpoint(cfg: Any) -> Path | None:
    """The newest complete step checkpoint of the run ``cfg`` describes, or None."""
    from rlcore.run.checkpoints import latest_step

    latest = latest_step(checkpoint_root(cfg))
    return latest[1] if latest else None


def resume_refusals(cfg: Any) -> list[str]:
    """Why ``--resume`` cannot continue this run, one line each (empty when it can): no complete checkpoint,
    or what is wrong in the newest one (:func:`rlcore.run.checkpoints.resume_problems`). Cheap, no Ray."""
    from rlcore.run.checkpoints import DamagedCheckpoint, complete_steps, resume_problems
    from rlcore.run.ownership import ownership_problems

    if problems := ownership_problems(cfg, resume=True):  # another algorithm's run
        return problems
    try:
        latest = latest_checkpoint(cfg)
        complete_steps(checkpoint_root(cfg))  # every step's state.json: the run reads them all when it saves
    except DamagedCheckpoint as exc:  # a state.json that cannot be read: one line, not a JSONDecodeError
        return [f"--resume: {exc}"]
    if latest is not None:
        return resume_problems(cfg.policy, latest)
    return [
        f"--resume: no complete checkpoint in {checkpoint_root(cfg)} (checkpointing.enabled="
        f"{cfg.checkpointing.enabled}); run without --resume to start fresh"
    ]


def resume_line(cfg: Any) -> str:
    """What ``--resume`` continues from, said first: the newest complete step checkpoint and the step
    checkpoints found (after :func:`resume_refusals` found nothing wrong)."""
    from rlcore.run.checkpoints import complete_steps, latest_step

    root = checkpoint_root(cfg)
    step, directory = latest_step(root) or (None, root)
    found = ", ".join(f"step {s}" for s in complete_steps(root))
    return f"rlcore run: resuming after step {step} (checkpoints: {found}) from {directory}"


def output_dir_problems(cfg: Any, resume: bool | None = None) -> list[str]:
    """Why the run cannot write ``logger.output_dir`` (its logs, metrics and checkpoints), one line: it holds
    another run's results (:func:`rlcore.run.ownership.ownership_problems`; checked when ``resume`` says
    whether the run resumes), or it cannot be written, found by creating it (as the run would) and a file in it
    and its ``logs/``. Cheap, no Ray."""
    import tempfile

    from rlcore.run.ownership import ownership_problems

    out = Path(cfg.logger.output_dir)
    if resume is not None and (problems := ownership_problems(cfg, resume)):
        return problems  # before anything is created or written there
    for directory in (out, run_log_dir(out)):
        try:
            directory.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=directory, prefix=".rlcore-write-check-"):
                pass
        except OSError as exc:
            return [
                f"logger.output_dir: cannot write {directory} ({_unwritable(directory, exc)}); choose a "
                "directory you can write (-o logger.output_dir=...) or make it writable"
            ]
    return []


def _unwritable(directory: Path, exc: OSError) -> str:
    """Why ``directory`` cannot be written, in a few words: a file where a directory must be, or the error's."""
    existing = next((p for p in (directory, *directory.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        return f"{existing} is not a directory"
    return exc.strerror or str(exc)


def data_position(cfg: Any, data: Any, next_batch: int) -> dict[str, Any]:
    """What a checkpoint records of the data: the next batch, and what that index means."""
    train = data.train
    return {
        "next_batch": next_batch,
        "epoch": train.epoch_of(next_batch),
        "batch_size": train.batch_size,
        "num_samples": train.num_samples,
        "seed": loop_setting(cfg, "seed", None),
    }


def resumed_data_position(cfg: Any, data: Any, saved: dict[str, Any] | None, start: int, where: Path) -> int:
    """The next batch a resumed run draws: the checkpoint's data position, which must belong to the same data
    stream (the same batch size, dataset size and seed; without dynamic sampling, one batch per step)."""
    if saved is None:
        return start  # a checkpoint from before the data position was recorded: batch = step, as it was then
    expected = data_position(cfg, data, start)
    from rlcore.config.schemas import load_algorithm

    one_batch_per_step = load_algorithm(cfg.algorithm).one_batch_per_step(cfg)
    keys = ("batch_size", "num_samples", "seed") + (("next_batch",) if one_batch_per_step else ())
    changed = [f"{key} {saved.get(key)} -> {expected[key]}" for key in keys if saved.get(key) != expected[key]]
    if changed:
        raise ValueError(
            f"--resume: {where} continued a different data stream ({', '.join(changed)}); resume with "
            "the data, batch size and seed it was written with, or start fresh"
        )
    return int(saved["next_batch"])


def ranking_metric(name: str | None, metrics: dict[str, float]) -> dict[str, Any]:
    """What a checkpoint records of ``checkpointing.metric_name`` (nothing on a step without validation when it
    is a validation metric); a name the step's metrics lack altogether is an error, not a silent ranking."""
    if name is None:
        return {}
    if name in metrics:
        return {"metrics": {name: metrics[name]}}
    if name.startswith("validation/") and not any(k.startswith("validation/") for k in metrics):
        return {}
    raise ValueError(
        f"checkpointing.metric_name: {name!r} is not a metric of this run; it has "
        f"{', '.join(sorted(k for k in metrics if not k.startswith(('time/', 'memory/'))))}"
    )


def train(
    config: Any,
    resume: bool = False,
    signals: Any = None,
    progress_file: Any = None,
    data: Any = None,
    tokenizer: Any = None,
) -> dict[str, Any]:
    """Build the run, train, checkpoint; returns a summary (first/last mean reward, paths).

    ``config``: a :class:`~rlcore.config.ResolvedConfig`, or an ``RLCoreConfig`` resolved here with
    ``rlcore run``'s defaults (its notices go to standard error). ``resume``: continue after the newest
    complete checkpoint (``FileNotFoundError`` if there is none); ``metrics.jsonl`` keeps one row per step.
    ``signals`` (a :class:`~rlcore.run.stopping.StopOnSignals`) holds a stop until a checkpoint being written
    is complete. ``progress_file``: where the progress bar goes (default standard error). ``data`` and
    ``tokenizer``: the samples :func:`rlcore.run.build.load_run_data` read already, with the tokenizer it used
    (loaded here when None). The data position is part of each checkpoint, so a resumed run continues with
    the next unseen batch. A fresh run refuses an output directory holding another run's results, and a resumed
    one another algorithm's run (:class:`rlcore.run.ownership.OutputDirTaken`); the run marks the directory its
    own (:data:`rlcore.run.ownership.MARKER`).
    """
    from rlcore.config.warm_start import unfinished_warm_start
    from rlcore.run.ownership import OutputDirLock

    resolved = config if isinstance(config, ResolvedConfig) else _resolved_with_notices(config)
    cfg = resolved.config
    if (unfinished := unfinished_warm_start(cfg)) is not None:
        raise unfinished
    out = Path(cfg.logger.output_dir)
    with OutputDirLock(out), _one_torch_thread():  # the lock: a second run started now is refused, not interleaved
        return _train_owned(resolved, resume, signals, progress_file, data, tokenizer)


@contextlib.contextmanager
def _one_torch_thread() -> Iterator[None]:
    """The driver's torch ops run on one thread while the run lasts (the caller's setting is restored after).

    They are bookkeeping on small tensors (rewards, advantages, padding, version tags); the engines and the
    trainers keep the cores busy, and an op split over two threads then waits for a core: measured with both
    cores busy, one such op took 16 ms at the 90th percentile with two threads and 0.1 ms with one."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _train_owned(
    resolved: ResolvedConfig,
    resume: bool,
    signals: Any,
    progress_file: Any,
    data: Any,
    tokenizer: Any,
) -> dict[str, Any]:
    """:func:`train`'s body, run while this process holds ``logger.output_dir``."""
    from rlcore.config.schemas import load_algorithm
    from rlcore.distributed.startup_signals import signal_self_at
    from rlcore.run.build import build_run, load_run_data
    from rlcore.run.checkpoints import latest_step, load_rollouts, read_state, resume_problems, save_step
    from rlcore.run.metrics import MetricsLogger, keep_steps_before, read_metrics
    from rlcore.run.ownership import OutputDirTaken, ownership_problems, write_marker
    from rlcore.run.prompts import load_tokenizer
    from rlcore.run.save_deadline import SaveDeadline, SaveDeadlineReached
    from rlcore.run.trackers import open_trackers

    cfg = resolved.config
    out = Path(cfg.logger.output_dir)
    if problems := ownership_problems(cfg, resume):  # another run's results are there: nothing of them changes
        raise OutputDirTaken("\n".join(problems))
    ckpt_root = checkpoint_root(cfg)
    resume_from = latest_step(ckpt_root) if resume else None
    if resume and resume_from is None:
        raise FileNotFoundError(resume_refusals(cfg)[0])
    start = resume_from[0] + 1 if resume_from else 0
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg)
    data = data if data is not None else load_run_data(cfg, tokenizer)
    next_batch = start
    if resume_from:
        next_batch = resumed_data_position(cfg, data, read_state(resume_from[1]).get("data"), start, resume_from[1])
        value_model = resolved.value_model.config if resolved.value_model is not None else None
        if problems := resume_problems(cfg.policy, resume_from[1], value_model):
            raise ValueError("\n".join(problems))  # before Ray starts
    write_marker(cfg, resume)
    (out / RUN_SUMMARY).unlink(missing_ok=True)  # finished again only when this run finishes
    keep_steps_before(out / "metrics.jsonl", start)  # a fresh run starts a fresh log; a resumed one drops re-run steps
    run = build_run(resolved, resume_from[1] if resume_from else None, start, tokenizer=tokenizer, data=data)
    run.next_batch = next_batch
    if resume_from:
        run.resumed_rollouts = load_rollouts(resume_from[1])  # generated ahead before the interruption
    logger = None
    deadline_reached = False
    last = run.num_steps - 1
    hold = signals.hold if signals is not None else contextlib.nullcontext
    ck = cfg.checkpointing
    algorithm = load_algorithm(cfg.algorithm)
    validate = algorithm.validate
    finished: dict[str, Any] = {}  # the newest finished step: "step", "metrics", "position", "saved"
    deadline = SaveDeadline(ck.checkpoint_must_save_by)  # its clock starts with training, as NeMo-RL's

    def save(step: int, metrics: dict[str, float], position: int) -> None:
        with hold():
            extra = {"data": data_position(cfg, data, position), **ranking_metric(ck.metric_name, metrics)}
            save_step(
                run.policy,
                ckpt_root,
                step,
                ck.keep_last,
                extra,
                (ck.metric_name, ck.higher_is_better) if ck.metric_name else None,
                run.carried_rollouts() if run.carried_rollouts is not None else None,
                run.value_model,
            )

    def on_step(step: int, metrics: dict[str, float]) -> None:
        if run.engines is not None:  # engine/restarts, and the next step's allowance of restarts
            metrics = {**metrics, **run.engines.end_step()}
        logger.log(step, metrics)
        position = step + 1 if run.resolved.async_generation else run.next_batch  # async draws by step, ahead
        due = deadline.step_done() and step != last  # checkpointing.checkpoint_must_save_by: save, then stop
        saved = ck.enabled and ((step + 1) % ck.save_every_n_steps == 0 or step == last or due)
        if saved:
            save(step, metrics, position)
        finished.update(step=step, metrics=metrics, position=position, saved=saved)
        if due:
            raise deadline.reached_after(step)

    def end_early(why: str) -> None:
        """The data ended inside a step: the step before it is the run's last (validated, saved)."""
        print(f"{why}; the run ends after step {finished.get('step', start - 1)}", file=sys.stderr)
        if not finished:
            return
        step, metrics = finished["step"], finished["metrics"]
        if loop_setting(cfg, "val_at_end", False) and data.validation and not _validated(metrics):
            validation = validate(run)
            logger.log(step, validation, advance=False)
            metrics = {**metrics, **validation}
        if ck.enabled and not finished["saved"]:
            save(step, metrics, finished["position"])  # not the unfinished step's draws: they are retried

    try:
        logger = MetricsLogger(
            out,
            tensorboard=cfg.logger.tensorboard,
            progress_bar=cfg.logger.progress_bar,
            progress_file=progress_file,
            total_steps=run.num_steps,
            initial_step=start,
            name=algorithm.name,
            curve=algorithm.curve,
            trackers=open_trackers(cfg, out, start, err=progress_file),
        )
        if loop_setting(cfg, "val_at_start", False) and start == 0 and data.validation:
            logger.log(-1, validate(run), advance=False)  # the initial weights
        signal_self_at("first_step")  # test hook (RLCORE_TEST_SIGNAL_AT), nothing when unset
        try:
            ended_early = algorithm.train(run, on_step)
        except SaveDeadlineReached as reached:  # the step was saved in on_step: the run ends here, cleanly
            ended_early, deadline_reached = str(reached), True
            print(ended_early, file=sys.stderr)
        else:
            if ended_early is not None:
                end_early(ended_early)
    except BaseException:
        if logger is not None:
            with contextlib.suppress(Exception):  # the run's error is the one worth reporting
                logger.close()
        with contextlib.suppress(Exception):
            run.shutdown()
        raise
    png = logger.close()
    run.shutdown()
    latest = latest_step(ckpt_root)
    summary = {
        **_summary(algorithm.headline, read_metrics(logger.path)),
        "metrics": str(logger.path),
        f"{algorithm.curve[2].removesuffix('.png')}": str(png) if png else None,
        "final_weights": str(latest[1] / "weights") if latest else None,
        **({"ended_early": ended_early} if ended_early else {}),
    }
    if not deadline_reached:  # a run its save deadline stopped is to be resumed: not finished
        _write_summary(out / RUN_SUMMARY, summary)
    return summary


def _write_summary(path: Path, summary: dict[str, Any]) -> None:
    """The finished run's summary, whole or not at all (``policy.warm_start`` reads it)."""
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    os.replace(partial, path)


def _validated(metrics: dict[str, Any]) -> bool:
    return any(key.startswith("validation/") for key in metrics)


def _summary(headline: tuple[str, str], logged: list[dict[str, Any]]) -> dict[str, Any]:
    """Steps trained and the first and last value of the algorithm's headline metrics
    (:attr:`rlcore.interfaces.algorithm.Algorithm.headline`: GRPO's mean reward and validation accuracy, SFT's
    loss and validation loss, ...)."""
    train_key, val_key = headline
    val_name = val_key.replace("/", "_")
    rows = [r for r in logged if train_key in r and r["step"] >= 0]  # training steps (not step -1)
    validations = [r[val_key] for r in logged if val_key in r]
    return {
        "steps": len({r["step"] for r in rows}),
        f"first_{train_key}": rows[0][train_key] if rows else None,
        f"last_{train_key}": rows[-1][train_key] if rows else None,
        **({f"first_{val_name}": validations[0], f"last_{val_name}": validations[-1]} if validations else {}),
    }


def _resolved_with_notices(cfg: Any) -> ResolvedConfig:
    resolved = resolve(cfg, run=True)
    for notice in resolved.notices:
        print(notice, file=sys.stderr)
    return resolved
