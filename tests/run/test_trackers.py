"""wandb and MLflow as experiment trackers, with no network: wandb offline (its run directory read back from the
``.wandb`` file), MLflow on a local file store read back with ``MlflowClient``.

The trackers are driven through the run's own :class:`~rlcore.run.metrics.MetricsLogger` and
:func:`~rlcore.run.trackers.open_trackers`, the calls ``rlcore.run.train`` makes, with rows shaped like a GRPO
run's (step -1's validation of the initial weights, a validation row after the last step, NaN, bools, a string).
"""

from __future__ import annotations

import importlib.util
import json
import math
import struct
import tempfile
from pathlib import Path

import pytest

from rlcore.config import ConfigError, load_config_dict
from rlcore.run.metrics import MetricsLogger, keep_steps_before, read_metrics

#: What a tracker receives of a row: what TensorBoard receives (numbers and bools).
NUMBERS = (int, float)


def rows(steps: range, seed: float) -> list[tuple[int, dict, bool]]:
    """``(step, metrics, advance)`` as a GRPO run logs them; ``seed`` makes one attempt's values its own."""
    out = []
    for step in steps:
        out.append(
            (
                step,
                {
                    "loss": seed + 1 / (step + 2),
                    "reward_mean": seed + step / 10,
                    "grad_norm": math.nan,
                    "time/step_s": 0.5 + step,
                    "skipped_steps": 0,
                    "clipped": step % 2 == 0,
                    "backend": "reference",
                },
                True,
            )
        )
        if step % 2 == 1:
            out.append((step, {"validation/accuracy": seed + step / 8}, False))  # validation after the step
    return out


def config(out: Path, **logger):
    return load_config_dict({"logger": {"output_dir": str(out), "tensorboard": False, "progress_bar": False, **logger}})


def attempt(cfg, start: int, logged: list[tuple[int, dict, bool]], fail: bool = False) -> None:
    """One attempt of a run, as ``rlcore.run.train`` makes it; ``fail``: it stops with an error."""
    from rlcore.run.trackers import open_trackers

    out = Path(cfg.logger.output_dir)
    keep_steps_before(out / "metrics.jsonl", start)
    logger = MetricsLogger(out, tensorboard=False, progress_bar=False, trackers=open_trackers(cfg, out, start))
    if start == 0:
        logger.log(-1, {"validation/accuracy": 0.125}, advance=False)
    try:
        for step, metrics, advance in logged:
            logger.log(step, metrics, advance=advance)
        if fail:
            raise RuntimeError("the training failed")
    except RuntimeError:
        logger.close()  # as train() does while the error is handled: the runs end as failed
        return
    logger.close()


def expected(path: Path) -> dict[tuple[int, str], float]:
    """Every number of every metrics.jsonl row, by (step, name)."""
    out: dict[tuple[int, str], float] = {}
    for row in read_metrics(path):
        for key, value in row.items():
            if key != "step" and isinstance(value, NUMBERS):
                out[(row["step"], key)] = float(value)
    return out


def same(a: dict[tuple[int, str], float], b: dict[tuple[int, str], float]) -> bool:
    return a.keys() == b.keys() and all(a[k] == b[k] or (math.isnan(a[k]) and math.isnan(b[k])) for k in a)


# -- wandb's offline run directory, read back ------------------------------------------------------------------


def wandb_records(path: Path):
    """The protobuf records of a ``.wandb`` file: a 7-byte header (``:W&B``, magic, version), then LevelDB-log
    framing in 32 KiB blocks (crc32, length, type: full, first, middle, last)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left  # the block's tail is padding
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            pos += left
            continue
        payload, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        pending = payload if kind in (1, 2) else pending + payload
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def wandb_run(run_dir: Path) -> tuple[str, dict, list[dict]]:
    """(run id, config, history rows) of one offline run directory."""
    run_id, cfg, history = "", {}, []
    for record in wandb_records(next(run_dir.glob("run-*.wandb"))):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id = record.run.run_id
            cfg = {item.key: json.loads(item.value_json) for item in record.run.config.update}
        elif kind == "history":
            history.append({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item})
    return run_id, cfg, history


def wandb_logged(runs: list[tuple[str, dict, list[dict]]]) -> dict[tuple[int, str], float]:
    """(step, name) -> value over the run's directories; a (step, name) logged twice fails."""
    out: dict[tuple[int, str], float] = {}
    for _run_id, _cfg, history in runs:
        for row in history:
            for key, value in row.items():
                if key == "step" or key.startswith("_"):
                    continue
                assert (row["step"], key) not in out, f"wandb holds step {row['step']} of {key} twice"
                out[(row["step"], key)] = float("nan") if value == "NaN" else float(value)
    return out


# -- MLflow's store, read back -----------------------------------------------------------------------------------


def mlflow_logged(client, run_id: str) -> dict[tuple[int, str], float]:
    """(step, name) -> value of every metric of the run; a (step, name) logged twice fails."""
    out: dict[tuple[int, str], float] = {}
    for key in client.get_run(run_id).data.metrics:
        for metric in client.get_metric_history(run_id, key):
            assert (metric.step, key) not in out, f"MLflow holds step {metric.step} of {key} twice"
            out[(metric.step, key)] = metric.value
    return out


@pytest.fixture
def trackers_offline(tmp_path, monkeypatch):
    with monkeypatch.context() as during_import:  # wandb makes two temporary directories when imported: here
        during_import.setattr(tempfile, "tempdir", str(tmp_path))
        pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps its file store behind this switch
    for var in ("WANDB_RUN_ID", "WANDB_RESUME", "MLFLOW_RUN_ID", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(var, raising=False)
    yield tmp_path
    import wandb

    wandb.teardown()  # its service process lives as long as the process that started it: not the test's


def test_wandb_and_mlflow_hold_every_metric_of_a_run_and_its_resume_once(trackers_offline, capsys):
    from mlflow.tracking import MlflowClient

    out, store = trackers_offline / "run", (trackers_offline / "mlruns").as_uri()
    cfg = config(
        out,
        wandb_enabled=True,
        wandb={"project": "rlcore-test", "name": "tiny"},
        mlflow_enabled=True,
        mlflow={"experiment_name": "rlcore-test", "run_name": "tiny", "tracking_uri": store},
    )
    # A 3-step run, then a crash after step 4 of a longer one whose last checkpoint was step 2.
    attempt(cfg, 0, rows(range(3), seed=0.0))
    first = expected(out / "metrics.jsonl")
    (first_dir,) = (out / "wandb").glob("offline-run-*")
    run_id, wandb_cfg, _ = wandb_run(first_dir)
    assert same(wandb_logged([wandb_run(first_dir)]), first) and len(first) == 3 * 6 + 2
    assert wandb_cfg["logger"]["wandb"] == {"project": "rlcore-test", "name": "tiny", "entity": None}
    assert wandb_cfg["policy"] == json.loads(json.dumps(cfg.model_dump(mode="json")["policy"]))
    client = MlflowClient(tracking_uri=store)
    (mlflow_run,) = client.search_runs([client.get_experiment_by_name("rlcore-test").experiment_id])
    assert same(mlflow_logged(client, mlflow_run.info.run_id), first)
    assert mlflow_run.info.run_name == "tiny" and mlflow_run.info.status == "FINISHED"
    assert mlflow_run.data.params["logger.mlflow.run_name"] == "tiny"
    assert mlflow_run.data.params["policy.learning_rate"] == str(cfg.policy.learning_rate)

    state = json.loads((out / "trackers.json").read_text())
    assert state["wandb"]["run_id"] == run_id and state["mlflow"]["run_id"] == mlflow_run.info.run_id
    attempt(cfg, 3, rows(range(3, 5), seed=1.0), fail=True)  # steps 3 and 4, then the crash
    interrupted = expected(out / "metrics.jsonl")
    assert client.get_run(mlflow_run.info.run_id).info.status == "FAILED"
    capsys.readouterr()
    attempt(cfg, 4, rows(range(4, 6), seed=2.0))  # resumed after step 3's checkpoint: 4 runs again, then 5
    said = [line for line in capsys.readouterr().err.splitlines() if "continues run" in line]
    assert said == [
        f"{name}: continues run {rid}, from step 4; step 4 keeps the values the interrupted attempt "
        "logged (metrics.jsonl has the re-run's)"
        for name, rid in (("wandb", run_id), ("mlflow", mlflow_run.info.run_id))
    ]

    resumed = expected(out / "metrics.jsonl")
    dirs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(dirs) == 3 and {wandb_run(d)[0] for d in dirs} == {run_id}  # one wandb run, synced in order
    # Every step once; step 4 keeps the interrupted attempt's values (metrics.jsonl has the re-run's).
    want = {**resumed, **{k: v for k, v in interrupted.items() if k[0] == 4}}
    assert same(wandb_logged([wandb_run(d) for d in dirs]), want)
    assert same(mlflow_logged(client, mlflow_run.info.run_id), want)
    assert {k[0] for k in want} == {-1, 0, 1, 2, 3, 4, 5}
    (again,) = client.search_runs([client.get_experiment_by_name("rlcore-test").experiment_id])
    assert again.info.run_id == mlflow_run.info.run_id and again.info.status == "FINISHED"


def test_a_tracker_that_cannot_start_is_one_line_naming_the_key(trackers_offline, monkeypatch):
    from rlcore.run.errors import RunError
    from rlcore.run.trackers import open_trackers

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")
    out = trackers_offline / "run"
    cfg = config(out, mlflow_enabled=True, mlflow={"tracking_uri": (trackers_offline / "mlruns").as_uri()})
    with pytest.raises(RunError) as caught:
        open_trackers(cfg, out, 0)
    text = str(caught.value)
    assert text.startswith("logger.mlflow.tracking_uri: mlflow could not start its run: MlflowException: ")
    assert "MLFLOW_ALLOW_FILE_STORE" in text and text.endswith(" (or set logger.mlflow_enabled=false)")
    assert "\n" not in text


class Flaky:
    name = "flaky"

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.closed: list[bool] = []

    def log(self, step, metrics):
        if step == 1:
            raise ConnectionError("server gone\nmore")
        self.steps.append(step)

    def close(self, failed=False):
        self.closed.append(failed)


def test_a_tracker_that_fails_is_dropped_with_one_line_and_the_rows_go_on(tmp_path, capsys):
    flaky = Flaky()
    logger = MetricsLogger(tmp_path, tensorboard=False, progress_bar=False, trackers=[flaky])
    for step in range(3):
        logger.log(step, {"loss": 1.0})
    logger.close()
    assert flaky.steps == [0] and flaky.closed == [True]
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2]
    assert capsys.readouterr().err.splitlines() == [
        "warning: flaky stopped logging at step 1: ConnectionError: server gone; metrics.jsonl has every row"
    ]


def test_trackers_get_the_numbers_of_a_row_and_end_failed_when_the_run_fails(tmp_path):
    class Recording(Flaky):
        def log(self, step, metrics):
            self.steps.append((step, metrics))

    tracker = Recording()
    logger = MetricsLogger(tmp_path, tensorboard=False, progress_bar=False, trackers=[tracker])
    logger.log(0, {"loss": 1, "ok": True, "name": "x", "grad_norm": math.inf})
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt:
        logger.close()
    assert tracker.steps == [(0, {"loss": 1.0, "ok": 1.0, "grad_norm": math.inf})] and tracker.closed == [True]


@pytest.mark.parametrize(
    "switch, package, extra", [("wandb_enabled", "wandb", "wandb"), ("mlflow_enabled", "mlflow", "mlflow")]
)
def test_a_tracker_switched_on_without_its_package_is_one_line(tmp_path, monkeypatch, switch, package, extra):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == package else real(name, *a))
    with pytest.raises(ConfigError) as caught:
        config(tmp_path, **{switch: True})
    assert caught.value.problems == [
        f"logger.{switch}: {package} is not installed: pip install 'rlcore[{extra}]' (or set logger.{switch}=false)"
    ]
    config(tmp_path, **{switch: False})  # off, nothing is needed


def test_a_database_store_without_sqlalchemy_is_one_line(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "sqlalchemy" else real(name, *a) or object()
    )
    with pytest.raises(ConfigError) as caught:
        config(tmp_path, mlflow_enabled=True, mlflow={"tracking_uri": "sqlite:///mlflow.db"})
    assert caught.value.problems == [
        "logger.mlflow: tracking_uri sqlite:///mlflow.db is a database store, which "
        "needs the full mlflow package, not mlflow-skinny: pip install mlflow"
    ]
    config(tmp_path, mlflow_enabled=True, mlflow={"tracking_uri": "http://localhost:5000"})


def test_nemo_rl_tracker_keys_are_mapped_not_ignored():
    from rlcore.nemo_rl import convert

    nemo = {
        "logger": {
            "log_dir": "logs",
            "wandb_enabled": True,
            "tensorboard_enabled": False,
            "mlflow_enabled": True,
            "wandb": {"project": "grpo-dev", "name": "grpo-dev-logger"},
            "mlflow": {
                "experiment_name": "grpo-dev",
                "run_name": "grpo-dev-logger",
                "tracking_uri": "http://localhost:5000",
            },
        }
    }
    conversion = convert(nemo)
    assert conversion.config["logger"] == {
        "output_dir": "logs",
        "wandb_enabled": True,
        "tensorboard": False,
        "mlflow_enabled": True,
        "wandb": {"project": "grpo-dev", "name": "grpo-dev-logger"},
        "mlflow": {
            "experiment_name": "grpo-dev",
            "run_name": "grpo-dev-logger",
            "tracking_uri": "http://localhost:5000",
        },
    }
    assert not [line for line in conversion.ignored_lines() if "wandb" in line or "mlflow" in line]


def test_a_fresh_run_does_not_continue_an_earlier_run_s_trackers(tmp_path):
    from rlcore.run.trackers import open_trackers

    (tmp_path / "trackers.json").write_text(json.dumps({"wandb": {"run_id": "old", "where": "/", "last_step": 9}}))
    assert open_trackers(config(tmp_path), tmp_path, 3) == [] and (tmp_path / "trackers.json").exists()
    assert open_trackers(config(tmp_path), tmp_path, 0) == [] and not (tmp_path / "trackers.json").exists()
