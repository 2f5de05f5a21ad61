"""The experiment trackers a config switches on, checked as their first minute would check them: wandb's
credentials and MLflow's store, and TensorBoard when the config asks for it by name. Without this, a run
found out 15-40 s in, after its workers had started (issue 52, item 9). That a tracker's package is installed,
and that a database ``tracking_uri`` has SQLAlchemy, the config itself checks (:mod:`rlcore.config.logger`)."""

from __future__ import annotations

import importlib.util
import netrc
import os
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlparse

from rlcore.config.logger import DATABASE_SCHEMES

if TYPE_CHECKING:
    from rlcore.config.logger import LoggerConfig, MlflowConfig

#: WANDB_MODE values under which wandb needs no credentials.
WANDB_LOCAL_MODES = ("offline", "disabled", "dryrun")


def tracker_problems(logger: LoggerConfig) -> list[str]:
    """What stops the trackers ``logger`` switches on from starting, one line each."""
    problems = []
    if logger.wandb_enabled:
        problems += wandb_problems()
    if logger.mlflow_enabled:
        problems += mlflow_problems(logger.mlflow)
    if logger.tensorboard and "tensorboard" in logger.model_fields_set and not _installed("tensorboard"):
        problems.append(
            "logger.tensorboard: is true, but tensorboard is not installed, so no events would be written; "
            "pip install tensorboard (rlcore[runtime] brings it), or set logger.tensorboard=false"
        )
    return problems


def wandb_problems() -> list[str]:
    """An API key where ``wandb.init`` looks (``WANDB_API_KEY``; ``wandb login`` writes ``~/.netrc``), unless
    ``WANDB_MODE`` keeps the run local."""
    if os.environ.get("WANDB_MODE", "").lower() in WANDB_LOCAL_MODES or os.environ.get("WANDB_API_KEY"):
        return []
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    if _netrc_has(host):
        return []
    return [
        f"logger.wandb_enabled: wandb has no API key for {host} here (WANDB_API_KEY, or `wandb login`, which "
        "writes ~/.netrc) and WANDB_MODE is not offline; log in, run with WANDB_MODE=offline (wandb sync "
        "uploads it later), or set logger.wandb_enabled=false"
    ]


def mlflow_problems(cfg: MlflowConfig) -> list[str]:
    """A store MLflow will open: MLflow 3 refuses its file store unless ``MLFLOW_ALLOW_FILE_STORE`` is set, and
    its default store when no ``tracking_uri`` is given may be a database, which needs the full ``mlflow``
    package (an explicit database ``tracking_uri`` the config refuses itself)."""
    import mlflow
    import mlflow.environment_variables as variables

    uri = cfg.tracking_uri or mlflow.get_tracking_uri()
    where = "logger.mlflow.tracking_uri" + ("" if cfg.tracking_uri else f" (unset: MLflow's default, {uri})")
    scheme = urlparse(uri).scheme
    if scheme in ("", "file") and hasattr(variables, "MLFLOW_ALLOW_FILE_STORE"):
        if not variables.MLFLOW_ALLOW_FILE_STORE.get():
            return [
                f"{where}: is a file store, which this MLflow refuses unless MLFLOW_ALLOW_FILE_STORE=true; set "
                "that, or give a tracking server (http://host:5000)"
            ]
    if not cfg.tracking_uri and scheme.split("+")[0] in DATABASE_SCHEMES and not _installed("sqlalchemy"):
        return [
            f"{where}: is a database store ({scheme}), which needs the full mlflow package (rlcore[mlflow] brings "
            "mlflow-skinny): pip install mlflow, or give a tracking server (http://host:5000)"
        ]
    return []


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _netrc_has(host: str) -> bool:
    path = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        return path.is_file() and netrc.netrc(str(path)).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False
