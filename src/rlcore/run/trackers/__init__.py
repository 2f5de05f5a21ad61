"""Experiment trackers: wandb and MLflow runs that receive every row of ``metrics.jsonl`` (same metrics, same step
numbers) and the resolved config as the run's parameters.

``metrics.jsonl`` and TensorBoard stay in :class:`rlcore.run.metrics.MetricsLogger`; a tracker is an extra
destination it feeds (:class:`~rlcore.run.trackers.base.Tracker`). Trackers are built-in classes rather than a
plugin kind (docs/trackers.md says why). Each tracker's package is imported only when it is switched on.
"""

from rlcore.run.trackers.base import Tracker, numeric_metrics
from rlcore.run.trackers.opening import open_trackers

__all__ = ["Tracker", "numeric_metrics", "open_trackers"]
