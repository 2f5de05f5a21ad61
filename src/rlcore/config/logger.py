"""The ``logger`` section: where a run's numbers go (metrics.jsonl always; TensorBoard, wandb and MLflow by choice).

The tracker keys are NeMo-RL's (``wandb_enabled``, ``wandb.project``, ``mlflow_enabled``, ``mlflow.tracking_uri``,
...), so a NeMo-RL config's logger section maps one to one. A tracker switched on whose package is missing is
refused here, when the config is checked, before anything starts (docs/trackers.md).
"""

from __future__ import annotations

import importlib.util

from pydantic import Field, ValidationInfo, field_validator

from rlcore.config.base import StrictModel

#: MLflow tracking URI schemes that are a database store (SQLAlchemy, which mlflow-skinny does not bring).
DATABASE_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")


class WandbConfig(StrictModel):
    """The Weights & Biases run (NeMo-RL's ``logger.wandb``); ``WANDB_MODE=offline`` writes it locally."""

    project: str | None = Field(None, description="The wandb project (none: wandb's default, or WANDB_PROJECT).")
    name: str | None = Field(None, description="The run's display name (none: wandb picks one).")
    entity: str | None = Field(None, description="The wandb team or user (none: wandb's default, or WANDB_ENTITY).")


class MlflowConfig(StrictModel):
    """The MLflow run (NeMo-RL's ``logger.mlflow``)."""

    experiment_name: str | None = Field(
        None, description="The MLflow experiment, created when missing (none: MLflow's default experiment)."
    )
    run_name: str | None = Field(None, description="The run's display name (none: MLflow picks one).")
    tracking_uri: str | None = Field(
        None,
        description="Where runs are stored: an http(s) server, or a database such as 'sqlite:///mlflow.db' "
        "(needs the full mlflow package); none: MLFLOW_TRACKING_URI, else MLflow's default.",
    )


class LoggerConfig(StrictModel):
    output_dir: str = Field("runs/latest", description="Directory for metrics.jsonl, plots, TensorBoard, checkpoints.")
    tensorboard: bool = Field(True, description="Also write TensorBoard events when tensorboard is installed.")
    progress_bar: bool = Field(True, description="Show a progress bar per step.")
    wandb_enabled: bool = Field(
        False,
        description="Also log every metrics.jsonl row and the resolved config to a "
        "wandb run (pip install rlcore[wandb]); --resume continues the same run.",
    )
    wandb: WandbConfig = Field(default_factory=WandbConfig, description="The wandb run, with wandb_enabled.")
    mlflow_enabled: bool = Field(
        False,
        description="Also log every metrics.jsonl row and the resolved config to an "
        "MLflow run (pip install rlcore[mlflow]); --resume continues the same run.",
    )
    mlflow: MlflowConfig = Field(default_factory=MlflowConfig, description="The MLflow run, with mlflow_enabled.")

    @field_validator("wandb_enabled", "mlflow_enabled")
    @classmethod
    def _installed(cls, on: bool, info: ValidationInfo) -> bool:
        package = info.field_name.removesuffix("_enabled")
        if on and importlib.util.find_spec(package) is None:
            raise ValueError(
                f"{package} is not installed: pip install 'rlcore[{package}]' (or set logger.{package}_enabled=false)"
            )
        return on

    @field_validator("mlflow")
    @classmethod
    def _store_usable(cls, mlflow: MlflowConfig, info: ValidationInfo) -> MlflowConfig:
        uri = mlflow.tracking_uri or ""
        scheme = uri.split(":", 1)[0].split("+", 1)[0].lower()
        if (
            info.data.get("mlflow_enabled")
            and scheme in DATABASE_SCHEMES
            and importlib.util.find_spec("sqlalchemy") is None
        ):
            raise ValueError(
                f"tracking_uri {uri} is a database store, which needs the full mlflow package, not "
                "mlflow-skinny: pip install mlflow"
            )
        return mlflow
