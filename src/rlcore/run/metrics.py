"""Where a run's numbers go: JSONL per step, TensorBoard when installed, the experiment trackers switched on
(:mod:`rlcore.run.trackers`: wandb, MLflow), a progress bar, a curve plot (the algorithm's
:attr:`~rlcore.interfaces.algorithm.Algorithm.curve`)."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _shown(value: Any, spec: str) -> str:
    """A number as the progress bar shows it; ``-`` when the step has none (a step that trained nothing has no
    loss: showing 0 would claim a perfect one)."""
    return format(value, spec) if isinstance(value, (int, float)) and not isinstance(value, bool) else "-"


class MetricsLogger:
    def __init__(
        self,
        output_dir: str | Path,
        *,
        tensorboard: bool = True,
        progress_bar: bool = True,
        progress_file: Any = None,
        total_steps: int = 0,
        initial_step: int = 0,
        name: str = "grpo",
        curve: tuple[str, str, str] = ("reward_mean", "mean reward", "reward_curve.png"),
        trackers: Sequence[Any] = (),
    ) -> None:
        """``name``: the progress bar's label; ``curve``: ``(metric, axis label, file name)`` of the plot
        (:attr:`rlcore.interfaces.algorithm.Algorithm.curve`); ``trackers``: started
        :class:`~rlcore.run.trackers.Tracker` objects, each given every row (:func:`rlcore.run.trackers.open_trackers`),
        and ended by :meth:`close`."""
        self.dir = Path(output_dir)
        self.curve = curve
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "metrics.jsonl"
        self._file = self.path.open("a")
        self._trackers = list(trackers)
        self._notices = progress_file  # a tracker's warning goes where the progress bar goes (None: stderr)
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.dir / "tensorboard"))
            except ImportError:  # tensorboard is optional
                self._tb = None
        self._bar = None
        if progress_bar:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total_steps, initial=initial_step, desc=name, unit="step", dynamic_ncols=True, file=progress_file
            )  # None: standard error

    def log(self, step: int, metrics: dict[str, Any], advance: bool = True) -> None:
        """Write one row; ``advance``: it is a training step (the progress bar moves)."""
        record = {"step": step, **metrics}
        try:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        except OSError as exc:  # a write's error names no file (a full disk): the run's line names this one
            raise OSError(exc.errno, exc.strerror, str(self.path)) from exc
        if self._tb is not None:
            for name, value in metrics.items():
                if isinstance(value, (int, float)):
                    self._tb.add_scalar(name, value, step)
        if self._trackers:
            self._to_trackers(step, metrics)
        if zeroed := zeroed_line(step, metrics):
            self._say(zeroed)
        if self._bar is not None and advance:
            postfix = {"loss": _shown(metrics.get("loss"), ".4f"), "step_s": _shown(metrics.get("time/step_s"), ".2f")}
            if "reward_mean" in metrics:
                postfix = {"reward": f"{metrics['reward_mean']:.3f}", **postfix}
            for key, short in (("validation/accuracy", "val_acc"), ("validation/loss", "val_loss")):
                if key in metrics:
                    postfix[short] = f"{metrics[key]:.3f}"
            self._bar.set_postfix(postfix, refresh=False)
            self._bar.update(1)

    def _say(self, line: str) -> None:
        """One line where the progress bar goes (the terminal under ``rlcore run``), above the bar."""
        if self._bar is not None:
            self._bar.write(line, file=self._notices or sys.stderr)  # tqdm's own default is stdout
        else:
            print(line, file=self._notices or sys.stderr)

    def _to_trackers(self, step: int, metrics: dict[str, Any]) -> None:
        """A tracker that fails (its server gone) is dropped with one line; the training goes on, and
        metrics.jsonl keeps every row."""
        from rlcore.run.trackers import numeric_metrics

        numbers = numeric_metrics(metrics)
        for tracker in list(self._trackers):
            try:
                tracker.log(step, numbers)
            except Exception as exc:  # noqa: BLE001 - a dashboard's outage must not end a training run
                self._trackers.remove(tracker)
                with contextlib.suppress(Exception):
                    tracker.close(failed=True)
                first = (str(exc).strip().splitlines() or [""])[0]
                self._say(
                    f"warning: {tracker.name} stopped logging at step {step}: {type(exc).__name__}: {first}; "
                    f"metrics.jsonl has every row"
                )

    def close(self) -> Path | None:
        """Close outputs and draw the curve; returns the PNG path (None without matplotlib). Called while an
        exception is being handled (the run failed or was stopped), the trackers' runs end as failed."""
        failed = sys.exc_info()[0] is not None
        for tracker in self._trackers:
            try:
                tracker.close(failed=failed)
            except Exception as exc:  # noqa: BLE001 - the other outputs still close
                print(
                    f"warning: {tracker.name} did not close its run: {type(exc).__name__}: {exc}",
                    file=self._notices or sys.stderr,
                )
        self._trackers = []
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._bar is not None:
            self._bar.close()
        metric, label, file = self.curve
        return plot_curve(self.path, self.dir / file, metric, label)


def zeroed_line(step: int, metrics: dict[str, Any]) -> str | None:
    """What a step zeroed, in one line (None when nothing): samples the environment failed or scored NaN/inf
    were trained with reward 0, which only metrics.jsonl and the driver log used to show."""
    failed = int(metrics.get("env/errors") or 0)
    if failed <= 0:
        return None
    nonfinite = int(metrics.get("env/nonfinite_rewards") or 0)
    kinds = ", ".join(
        part
        for part in (
            f"{nonfinite} non-finite reward{'s' * (nonfinite != 1)}" if nonfinite else "",
            f"{failed - nonfinite} environment error{'s' * (failed - nonfinite != 1)}" if failed > nonfinite else "",
        )
        if part
    )
    first = metrics.get("env/first_error")
    return f"step {step}: {failed} sample{'s' * (failed != 1)} scored 0 ({kinds})" + (
        f"; the first, {first}" if first else ""
    )


def keep_steps_before(path: str | Path, step: int) -> None:
    """Drop the rows of ``step`` and later from a metrics file (a resumed run writes them again)."""
    path = Path(path)
    if not path.exists():
        return
    kept = [json.dumps(row) + "\n" for row in read_metrics(path) if row["step"] < step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept))
    tmp.replace(path)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot_curve(metrics_path: str | Path, png_path: str | Path, metric: str, label: str) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [r for r in read_metrics(metrics_path) if metric in r and r["step"] >= 0]
    if not rows:
        return None
    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, [r[metric] for r in rows], marker="o", label=label)
    ax.set_xlabel("step")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return Path(png_path)
