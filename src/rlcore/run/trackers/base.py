"""What a tracker is, and which values of a metrics row it receives."""

from __future__ import annotations

from typing import Any, Protocol


class Tracker(Protocol):
    """A destination for a run's metric rows (wandb, MLflow)."""

    #: The tracker's name in messages and in ``trackers.json`` (``'wandb'``, ``'mlflow'``).
    name: str

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Record one row (``step`` as in metrics.jsonl: -1 is the validation of the initial weights)."""

    def close(self, failed: bool = False) -> None:
        """End the run: finished, or ``failed`` (the training raised or was stopped)."""


def numeric_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """The numbers of a row (what TensorBoard gets too: ints, floats and bools), as floats; NaN and inf stay."""
    return {key: float(value) for key, value in metrics.items() if isinstance(value, (int, float))}
