"""The trackers a config switches on are checked before Ray (issue 52, item 9): wandb without credentials,
MLflow 3's file store without ``MLFLOW_ALLOW_FILE_STORE``, a database store without SQLAlchemy and TensorBoard
asked for by name without tensorboard were found 15-40 s into a run, after its workers started. Each line is
checked against what the tracker itself does with the same settings (wandb's lookup, MLflow's store)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from rlcore.config.logger import LoggerConfig, MlflowConfig
from rlcore.preflight import trackers
from rlcore.preflight.trackers import mlflow_problems, tracker_problems, wandb_problems
from tests.preflight.test_preflight_run import ROOT, validate

NO_KEY = (
    "logger.wandb_enabled: wandb has no API key for api.wandb.ai here (WANDB_API_KEY, or `wandb login`, which "
    "writes ~/.netrc) and WANDB_MODE is not offline; log in, run with WANDB_MODE=offline (wandb sync uploads it "
    "later), or set logger.wandb_enabled=false"
)


@pytest.fixture
def no_wandb_credentials(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No key in the environment, a ~/.netrc of another host, no local mode: what a first run on a new machine
    has."""
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    netrc = tmp_path / "netrc"
    netrc.write_text("machine example.org login user password secret\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    return netrc


def test_wandb_without_credentials_is_one_line_and_each_way_to_give_them_passes(no_wandb_credentials, monkeypatch):
    assert wandb_problems() == [NO_KEY]
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert wandb_problems() == []
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_problems() == []
    monkeypatch.delenv("WANDB_API_KEY")
    no_wandb_credentials.write_text("machine api.wandb.ai login user password " + "k" * 40 + "\n")  # wandb login's
    assert wandb_problems() == []


@pytest.mark.parametrize("allowed", [False, True])
def test_mlflow_s_file_store_is_refused_exactly_when_mlflow_refuses_it(tmp_path, monkeypatch, allowed):
    pytest.importorskip("mlflow")
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    if allowed:
        monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    else:
        monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    uri = (tmp_path / "mlruns").as_uri()
    try:  # the reference: MLflow's own client on the same store
        MlflowClient(tracking_uri=uri).search_experiments()
        refused = False
    except MlflowException:
        refused = True
    lines = mlflow_problems(MlflowConfig(tracking_uri=uri))
    assert bool(lines) == refused
    if refused:
        assert lines == [
            "logger.mlflow.tracking_uri: is a file store, which this MLflow refuses unless "
            "MLFLOW_ALLOW_FILE_STORE=true; set that, or give a tracking server (http://host:5000)"
        ]


def test_mlflow_s_default_database_store_needs_sqlalchemy_and_a_server_needs_nothing_here(tmp_path, monkeypatch):
    """MLflow 3's default store, with no tracking_uri, is a sqlite database (an explicit one the config itself
    refuses without SQLAlchemy: rlcore.config.logger)."""
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    lines = mlflow_problems(MlflowConfig())
    if importlib.util.find_spec("sqlalchemy") is None:
        assert lines == [
            f"logger.mlflow.tracking_uri (unset: MLflow's default, sqlite:///{tmp_path / 'mlflow.db'}): is a "
            "database store (sqlite), which needs the full mlflow package (rlcore[mlflow] brings mlflow-skinny): pip "
            "install mlflow, or give a tracking server (http://host:5000)"
        ]
    else:
        assert lines == []
    assert not (tmp_path / "mlflow.db").exists()  # checked, not created
    assert mlflow_problems(MlflowConfig(tracking_uri="http://127.0.0.1:5000")) == []  # no request is made


def test_tensorboard_asked_for_by_name_must_be_there(monkeypatch):
    monkeypatch.setattr(trackers, "_installed", lambda module: module != "tensorboard")
    assert tracker_problems(LoggerConfig(tensorboard=True)) == [
        "logger.tensorboard: is true, but tensorboard is not installed, so no events would be written; pip install "
        "tensorboard (rlcore[runtime] brings it), or set logger.tensorboard=false"
    ]
    assert tracker_problems(LoggerConfig()) == []  # the default: events when it is installed
    monkeypatch.setattr(trackers, "_installed", lambda module: True)
    assert tracker_problems(LoggerConfig(tensorboard=True)) == []


def test_config_validate_says_it_before_ray(no_wandb_credentials, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env["NETRC"] = str(no_wandb_credentials)
    code, lines, _ = validate(
        str(ROOT / "examples" / "sft_tiny.yaml"), "-o", "logger.wandb_enabled=true", tmp_path=tmp_path, env=env
    )
    assert (code, lines) == (1, [NO_KEY])
