"""An MLflow run fed with metrics.jsonl's rows (``logger.mlflow_enabled``), through ``MlflowClient``.

The resolved config is the run's parameters, one per dotted key. MLflow keeps a parameter's first value: a
resumed run adds the keys the run lacks and leaves the others as the run started with them.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

#: MLflow's own batch limits (``log_batch``).
PARAMS_PER_BATCH = 100
METRICS_PER_BATCH = 1000
#: What MLflow allows in a metric or parameter name; anything else becomes '_'.
_NOT_ALLOWED = re.compile(r"[^\w\-. /:]")


class MlflowTracker:
    name = "mlflow"

    def __init__(self, cfg: Any) -> None:
        """``cfg``: the :class:`~rlcore.config.logger.MlflowConfig`."""
        import mlflow
        from mlflow.tracking import MlflowClient

        self.cfg = cfg
        uri = cfg.tracking_uri or mlflow.get_tracking_uri()
        self.where = f"{uri}#{cfg.experiment_name or ''}"
        self.client = MlflowClient(tracking_uri=uri)
        self.run_id: str | None = None

    def start(self, params: dict[str, Any], run_id: str | None) -> str:
        """Start a run, or continue ``run_id`` when the store still has it; ``params``: the resolved config."""
        known: dict[str, str] = {}
        if run_id and (run := self._live_run(run_id)) is not None:
            self.run_id = run_id
            known = dict(run.data.params)
            self.client.update_run(run_id, status="RUNNING")
        else:
            self.run_id = self.client.create_run(self._experiment_id(), run_name=self.cfg.run_name).info.run_id
        self._log_params({k: v for k, v in flat_params(params).items() if k not in known})
        return self.run_id

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        rows = [Metric(_name(key), value, now, step) for key, value in metrics.items()]
        for i in range(0, len(rows), METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=rows[i : i + METRICS_PER_BATCH])

    def close(self, failed: bool = False) -> None:
        if self.run_id is not None:
            self.client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")
            self.run_id = None

    def _live_run(self, run_id: str) -> Any:
        from mlflow.exceptions import MlflowException

        try:
            run = self.client.get_run(run_id)
        except MlflowException:
            return None
        return None if run.info.lifecycle_stage == "deleted" else run

    def _experiment_id(self) -> str:
        name = self.cfg.experiment_name or "Default"
        experiment = self.client.get_experiment_by_name(name)
        if experiment is not None and experiment.lifecycle_stage != "deleted":
            return experiment.experiment_id
        return self.client.create_experiment(name)

    def _log_params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        rows = [Param(key, value) for key, value in params.items()]
        for i in range(0, len(rows), PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=rows[i : i + PARAMS_PER_BATCH])


def flat_params(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """``{'a': {'b': 1}}`` -> ``{'a.b': '1'}``: strings as they are, other leaves (lists too) as JSON, each
    within MLflow's length limit."""
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

    out: dict[str, str] = {}
    for key, value in config.items():
        path = f"{prefix}{_name(str(key))}"
        if isinstance(value, dict) and value:
            out.update(flat_params(value, path + "."))
        else:
            out[path] = (value if isinstance(value, str) else json.dumps(value))[:MAX_PARAM_VAL_LENGTH]
    return out


def _name(key: str) -> str:
    return _NOT_ALLOWED.sub("_", key)
