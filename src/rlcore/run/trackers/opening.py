"""Start the trackers a config switches on, continuing their runs on ``--resume``.

On a resumed run (``start`` > 0) a tracker continues the run recorded in ``<output_dir>/trackers.json``. Steps
from ``start`` up to the last step that run logged were logged by the interrupted attempt after its last
checkpoint; they are not logged again (a run never holds a step twice), so for those steps the tracker keeps the
interrupted attempt's values while metrics.jsonl holds the re-run's. Every later step is logged as usual.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

from rlcore.run.errors import RunError
from rlcore.run.trackers.base import Tracker
from rlcore.run.trackers.state import FILE_NAME, TrackerState


def open_trackers(cfg: Any, output_dir: str | Path, start: int = 0, err: Any = None) -> list[Tracker]:
    """The trackers ``cfg.logger`` switches on (an :class:`~rlcore.config.RLCoreConfig`), started; ``start``: the
    first step this attempt trains (0: a fresh run). Notices go to ``err`` (None: standard error), the terminal
    under ``rlcore run``."""
    logger = cfg.logger
    out = Path(output_dir)
    if start == 0:  # a fresh run: an earlier run's tracker runs are not this run's to continue
        (out / FILE_NAME).unlink(missing_ok=True)
    chosen = [name for name, on in (("wandb", logger.wandb_enabled), ("mlflow", logger.mlflow_enabled)) if on]
    if not chosen:
        return []
    out.mkdir(parents=True, exist_ok=True)
    state = TrackerState(out)
    params = cfg.model_dump(mode="json")
    opened: list[Tracker] = []
    try:
        for name in chosen:
            opened.append(_open(name, logger, out, params, state, start, err or sys.stderr))
    except BaseException:
        for tracker in opened:
            with contextlib.suppress(Exception):
                tracker.close(failed=True)
        raise
    return opened


def _open(
    name: str, logger: Any, out: Path, params: dict[str, Any], state: TrackerState, start: int, err: Any
) -> Tracker:
    key = "logger.wandb" if name == "wandb" else "logger.mlflow.tracking_uri"
    try:
        tracker = _tracker(name, logger, out)
        previous = state.previous(name, tracker.where) if start > 0 else None
        run_id = tracker.start(params, previous["run_id"] if previous else None)
    except Exception as exc:
        raise RunError(
            f"{key}: {name} could not start its run: {_first_line(exc)} (or set logger.{name}_enabled=false)"
        ) from exc
    last = previous.get("last_step") if previous else None
    state.started(name, run_id, tracker.where, last)
    skip_through = last if isinstance(last, int) and last >= start else None
    if start > 0:
        how = f"continues run {run_id}" if previous and run_id == previous["run_id"] else f"starts run {run_id}"
        steps = f"step {start}" if last == start else f"steps {start}-{last}"
        kept = (
            f"; {steps} keep{'s' if last == start else ''} the values the interrupted attempt logged "
            "(metrics.jsonl has the re-run's)"
            if skip_through is not None
            else ""
        )
        print(f"{name}: {how}, from step {start}{kept}", file=err)
    return RecordedTracker(tracker, state, skip_through)


def _tracker(name: str, logger: Any, out: Path) -> Any:
    if name == "wandb":
        from rlcore.run.trackers.wandb_tracker import WandbTracker

        return WandbTracker(logger.wandb, out)
    from rlcore.run.trackers.mlflow_tracker import MlflowTracker

    return MlflowTracker(logger.mlflow)


class RecordedTracker:
    """A started tracker that leaves out the steps its run already holds and records each step it logs."""

    def __init__(self, tracker: Any, state: TrackerState, skip_through: int | None) -> None:
        self.tracker = tracker
        self.name = tracker.name
        self.state = state
        self.skip_through = skip_through

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self.skip_through is not None and step <= self.skip_through:
            return
        self.tracker.log(step, metrics)
        self.state.logged(self.name, step)

    def close(self, failed: bool = False) -> None:
        self.tracker.close(failed)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
