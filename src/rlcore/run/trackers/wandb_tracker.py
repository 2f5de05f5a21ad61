"""A Weights & Biases run fed with metrics.jsonl's rows (``logger.wandb_enabled``).

Each row is logged with its step as the ``step`` metric, the x axis of every other metric (``define_metric``):
wandb's own step only grows, and a run's rows include step -1 (the initial weights' validation) and a second
row for one step (validation after the last step). The run's files go to ``<output_dir>/wandb``; offline
(``WANDB_MODE=offline``), ``wandb sync <output_dir>/wandb/offline-run-*`` uploads them, a resumed run's
directories in order.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: The metric holding metrics.jsonl's step number.
STEP_METRIC = "step"


class WandbTracker:
    name = "wandb"

    def __init__(self, cfg: Any, output_dir: Path) -> None:
        """``cfg``: the :class:`~rlcore.config.logger.WandbConfig`."""
        self.cfg = cfg
        self.output_dir = Path(output_dir)
        self.where = f"{cfg.entity or ''}/{cfg.project or ''}"
        self.run: Any = None

    def start(self, params: dict[str, Any], run_id: str | None) -> str:
        """Start a run, or continue ``run_id``; ``params``: the resolved config (the run's config)."""
        import wandb

        resume = {"id": run_id, "resume": "allow", "allow_val_change": True} if run_id else {}
        self.run = wandb.init(
            project=self.cfg.project,
            name=self.cfg.name,
            entity=self.cfg.entity,
            dir=str(self.output_dir),
            config=params,
            **resume,
        )
        self.run.define_metric(STEP_METRIC)
        self.run.define_metric("*", step_metric=STEP_METRIC)
        return str(self.run.id)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log({**metrics, STEP_METRIC: step})

    def close(self, failed: bool = False) -> None:
        if self.run is not None:
            self.run.finish(exit_code=1 if failed else 0)
            self.run = None
