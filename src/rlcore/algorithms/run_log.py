"""Moved: a run's metrics (JSONL, TensorBoard, progress bar, reward plot) are :mod:`rlcore.run.metrics`."""

from rlcore.run.metrics import (
    MetricsLogger,
    keep_steps_before,
    plot_rewards,
    read_metrics,
)

__all__ = ["MetricsLogger", "keep_steps_before", "plot_rewards", "read_metrics"]
