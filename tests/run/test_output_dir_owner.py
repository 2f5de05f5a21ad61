"""An output directory is owned by the run that wrote it (issue 44, item 1): NeMo-RL's sft.yaml and dpo.yaml both
log to ``logs``, and a DPO run there must refuse, in one line before Ray starts, rather than replace the SFT run's
checkpoint and append to its metrics. The first run is made by the run's own writers (the marker, a step
checkpoint through ``save_step``, a metrics row through ``MetricsLogger``), so no training runs here."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from rlcore.nemo_rl import load_nemo_rl_config
from rlcore.run.ownership import MARKER, OutputDirTaken, config_hash, read_marker, write_marker
from rlcore.run.train import checkpoint_root, output_dir_problems, resume_refusals

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "nemo_rl"
SFT_YAML, DPO_YAML = FIXTURES / "main" / "sft.yaml", FIXTURES / "main" / "dpo.yaml"
WORDS = ("abc", "bcd", "cab", "dab", "abd", "bad", "cad", "dca")
#: A run before Ray: pre-Ray refusals must come in well under this (a cold ``rlcore`` import included).
BEFORE_RAY_S = 60


def data_files(root: Path) -> tuple[Path, Path]:
    """Chat rows for SFT, prompt/chosen/rejected pairs for DPO (the local copies of what NeMo-RL downloads)."""
    chat, pairs = root / "chat.jsonl", root / "pairs.jsonl"
    chat.write_text(
        "".join(
            json.dumps(
                {"messages": [{"role": "user", "content": f"reverse {w}"}, {"role": "assistant", "content": w[::-1]}]}
            )
            + "\n"
            for w in WORDS
        )
    )
    pairs.write_text(
        "".join(json.dumps({"prompt": f"reverse {w}", "chosen": w[::-1], "rejected": w}) + "\n" for w in WORDS)
    )
    return chat, pairs


#: The tiny local model and batches that 8 rows fill, on CPU.
TINY = [
    "policy.model_name=tiny-llama",
    "policy.precision=float32",
    "policy.train_global_batch_size=4",
    "policy.train_micro_batch_size=2",
    "policy.max_total_sequence_length=64",
]


def sft_overrides(chat: Path) -> list[str]:
    return [
        *TINY,
        f"++data.train.data_path={chat}",
        f"++data.validation.data_path={chat}",
        "cluster.gpus_per_node=2",
        "sft.val_global_batch_size=4",
        "sft.val_micro_batch_size=2",
    ]


def dpo_overrides(pairs: Path) -> list[str]:
    return [
        *TINY,
        "policy.tokenizer.name=${policy.model_name}",
        f"++data.train.data_path={pairs}",
        f"++data.validation.data_path={pairs}",
        "++data.default.dataset_name=BinaryPreferenceDataset",
        "~data.train.dataset_name",
        "~data.validation.dataset_name",
        "dpo.val_global_batch_size=4",
        "dpo.val_micro_batch_size=2",
    ]


def nemo_config(path: Path, overrides: list[str], log_dir: Path) -> Any:
    return load_nemo_rl_config(path, [*overrides, f"logger.log_dir={log_dir}"], ["cluster.use_gpu=false"]).config


class CopyingPolicy:
    """What a training backend's ``save_checkpoint`` leaves: HF weights, an optimizer state, the tokenizer."""

    def __init__(self, model_dir: str) -> None:
        self.model_dir = model_dir

    def save_checkpoint(self, weights: str, optimizer: str, tokenizer: str) -> None:
        import torch

        shutil.copytree(self.model_dir, weights)
        Path(optimizer).mkdir()
        torch.save({"step": torch.tensor(1), "exp_avg": torch.zeros(3)}, Path(optimizer) / "optim.pt")
        Path(tokenizer).mkdir()


def first_run(cfg: Any, model_dir: str, steps: int = 2) -> Path:
    """The files a run of ``cfg`` leaves (``steps`` checkpoints, a metrics row each, a driver log), written
    by the run's own writers."""
    from rlcore.run.checkpoints import save_step
    from rlcore.run.metrics import MetricsLogger

    out = Path(cfg.logger.output_dir)
    write_marker(cfg, resume=False)
    logger = MetricsLogger(out, tensorboard=False, progress_bar=False)
    for step in range(steps):
        logger.log(step, {"loss": 1.0 / (step + 1)})
        save_step(CopyingPolicy(model_dir), checkpoint_root(cfg), step, 3, {"data": {"next_batch": step + 1}})
    logger.close()
    (out / "logs").mkdir(exist_ok=True)
    (out / "logs" / "driver.log").write_text("the first run's log\n")
    return out


def fingerprint(root: Path) -> dict[str, str]:
    """Every file and link under ``root`` with a hash of its bytes (a link: where it points)."""
    found = {}
    for path in sorted(root.rglob("*")):
        key = str(path.relative_to(root))
        if path.is_symlink():
            found[key] = "-> " + os.readlink(path)
        elif path.is_file():
            found[key] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


@pytest.fixture
def sft_then_dpo(tmp_path: Path, tiny_model_dir: str) -> tuple[Any, Any, Path]:
    """An SFT run's files in ``logs`` (NeMo-RL's sft.yaml), and NeMo-RL's dpo.yaml pointed at the same place."""
    chat, pairs = data_files(tmp_path)
    logs = tmp_path / "logs"
    sft = nemo_config(SFT_YAML, sft_overrides(chat), logs)
    dpo = nemo_config(DPO_YAML, dpo_overrides(pairs), logs)
    assert sft.algorithm == "sft" and dpo.algorithm == "dpo"
    assert Path(sft.logger.output_dir) == Path(dpo.logger.output_dir) == logs
    first_run(sft, tiny_model_dir)
    return sft, dpo, logs


def test_a_dpo_run_refuses_the_sft_run_s_directory_and_changes_nothing(sft_then_dpo) -> None:
    sft, dpo, logs = sft_then_dpo
    before = fingerprint(logs)
    assert {"metrics.jsonl", MARKER, "logs/driver.log", "checkpoints/step_000001/state.json"} <= set(before)
    started = read_marker(logs)["started"]
    assert output_dir_problems(dpo, resume=False) == [
        f"logger.output_dir: {logs} holds the sft run started {started} (checkpoints/, metrics.jsonl), which this "
        f"run would overwrite; write this run to a fresh directory (-o logger.output_dir={logs}-dpo), or "
        "continue that run with --resume and its own config"
    ]
    with pytest.raises(OutputDirTaken, match=r"holds the sft run started"):  # the Python API, before Ray
        from rlcore.run.train import train

        train(dpo)
    assert fingerprint(logs) == before


def test_resuming_the_sft_run_with_the_dpo_config_is_refused_the_same_way(sft_then_dpo) -> None:
    sft, dpo, logs = sft_then_dpo
    before = fingerprint(logs)
    started = read_marker(logs)["started"]
    line = (
        f"--resume: {logs} holds the sft run started {started}, and this config trains dpo; resume it with the "
        f"config it was started with, or write this dpo run to a fresh directory "
        f"(-o logger.output_dir={logs}-dpo)"
    )
    assert resume_refusals(dpo) == [line] and output_dir_problems(dpo, resume=True) == [line]
    assert output_dir_problems(sft, resume=True) == []  # its own run resumes
    assert fingerprint(logs) == before


def test_the_same_config_again_without_resume_is_refused_with_the_resume_hint(sft_then_dpo) -> None:
    sft, _, logs = sft_then_dpo
    started = read_marker(logs)["started"]
    assert output_dir_problems(sft, resume=False) == [
        f"logger.output_dir: {logs} holds this config's run (checkpoints/, metrics.jsonl; started {started}), which "
        f"a fresh start would overwrite; continue it with --resume, or start again in a fresh directory "
        f"(-o logger.output_dir={logs}-2)"
    ]
    (logs.parent / "logs-2").mkdir()  # the suggestion is a directory that does not exist yet
    assert f"-o logger.output_dir={logs}-3)" in output_dir_problems(sft, resume=False)[0]


def test_a_run_from_before_markers_is_protected_too(sft_then_dpo) -> None:
    _, dpo, logs = sft_then_dpo
    (logs / MARKER).unlink()
    (line,) = output_dir_problems(dpo, resume=False)
    assert line.startswith(
        f"logger.output_dir: {logs} holds a run's files (checkpoints/, metrics.jsonl) from before "
        f"rlcore marked its runs ({MARKER}), which this run would overwrite;"
    ), line
    assert "--resume" in line and f"{logs}-dpo" in line
    shutil.rmtree(logs / "checkpoints")  # metrics rows alone are a run's results
    (line,) = output_dir_problems(dpo, resume=False)
    assert "(metrics.jsonl)" in line
    assert output_dir_problems(dpo, resume=True) == []  # an unmarked run may be resumed (as before markers)


def test_a_directory_without_results_is_used_as_before(tmp_path: Path) -> None:
    """A run that stopped before its first step (marker and logs only), or files that are no run's."""
    chat, pairs = data_files(tmp_path)
    sft = nemo_config(SFT_YAML, sft_overrides(chat), tmp_path / "logs")
    write_marker(sft, resume=False)
    (tmp_path / "logs" / "logs").mkdir()
    (tmp_path / "logs" / "notes.txt").write_text("mine")
    (tmp_path / "logs" / "metrics.jsonl").write_text("")
    dpo = nemo_config(DPO_YAML, dpo_overrides(pairs), tmp_path / "logs")
    assert output_dir_problems(dpo, resume=False) == output_dir_problems(sft, resume=False) == []
    assert output_dir_problems(dpo) == []  # a caller that does not say whether it resumes: writability only


def test_the_marker_says_whose_run_it_is_and_a_resume_keeps_the_start(tmp_path: Path) -> None:
    from rlcore import __version__

    chat, _ = data_files(tmp_path)
    sft = nemo_config(SFT_YAML, sft_overrides(chat), tmp_path / "a")
    write_marker(sft, resume=False)
    marker = json.loads((tmp_path / "a" / MARKER).read_text())
    assert marker["algorithm"] == "sft" and marker["rlcore_version"] == __version__
    assert marker["config_hash"] == config_hash(sft)
    assert abs(time.time() - _epoch(marker["started"])) < 60
    # the hash is the config's: the same config elsewhere hashes the same, another value does not
    assert config_hash(nemo_config(SFT_YAML, sft_overrides(chat), tmp_path / "b")) == config_hash(sft)
    other = nemo_config(SFT_YAML, [*sft_overrides(chat), "sft.max_num_steps=7"], tmp_path / "a")
    assert config_hash(other) != config_hash(sft)
    write_marker(other, resume=True)  # a resume (with a longer run, say) keeps the first start
    resumed = json.loads((tmp_path / "a" / MARKER).read_text())
    assert resumed["started"] == marker["started"] and len(resumed["resumed"]) == 1
    assert resumed["config_hash"] == config_hash(other)
    assert [p.name for p in (tmp_path / "a").iterdir()] == [MARKER]  # written atomically: no temporary left


def _epoch(stamp: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(stamp).timestamp()


def rlcore_without_ray(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    """``rlcore run ...`` from ``tmp_path`` with a stand-in ``ray`` that fails if anything imports it."""
    stub = tmp_path / "stub" / "ray"
    stub.mkdir(parents=True, exist_ok=True)
    (stub / "__init__.py").write_text("raise ImportError('ray must not be imported')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(stub.parent), os.environ.get("PYTHONPATH")]))}
    began = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "rlcore", "run", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=BEFORE_RAY_S * 2,
    )
    return proc, time.monotonic() - began


def test_rlcore_run_of_dpo_yaml_after_sft_yaml_refuses_in_one_line_before_ray(
    tmp_path: Path, tiny_model_dir: str
) -> None:
    """NeMo-RL's own files as a user runs them: both say ``logger.log_dir: logs``, relative to where they run."""
    chat, pairs = data_files(tmp_path)
    first_run(nemo_config(SFT_YAML, sft_overrides(chat), tmp_path / "logs"), tiny_model_dir)
    before = fingerprint(tmp_path / "logs")
    proc, took = rlcore_without_ray(
        tmp_path, "--from", "nemo-rl", str(DPO_YAML), *dpo_overrides(pairs), "-o", "cluster.use_gpu=false"
    )
    lines = [ln for ln in proc.stderr.splitlines() if not ln.startswith(("notice:", "ignored:"))]
    started = read_marker(tmp_path / "logs")["started"]
    assert proc.returncode == 1, proc.stderr
    assert lines == [
        f"logger.output_dir: logs holds the sft run started {started} (checkpoints/, metrics.jsonl), "
        "which this run would overwrite; write this run to a fresh directory (-o logger.output_dir="
        "logs-dpo), or continue that run with --resume and its own config"
    ], proc.stderr
    assert took < BEFORE_RAY_S, took
    assert fingerprint(tmp_path / "logs") == before
    assert not (tmp_path / "logs-dpo").exists()


#: Each contender: wait for the go file, try to hold the directory, say which, keep it a moment.
CONTENDER = """
import os, sys, time
from pathlib import Path
from rlcore.run.ownership import OutputDirLock, OutputDirTaken
out, go = Path(sys.argv[1]), Path(sys.argv[2])
print("ready", flush=True)
while not go.exists():
    time.sleep(0.0005)
try:
    with OutputDirLock(out):
        print("won", flush=True)
        time.sleep(0.5)
except OutputDirTaken as exc:
    print("refused:", exc, flush=True)
"""


def test_two_runs_released_together_into_one_directory_exactly_one_proceeds(tmp_path: Path) -> None:
    """20 times: two processes released by one file into a directory that does not exist yet; one holds it,
    the other is refused in one line (the check and the claim cannot interleave: the hold is a lock)."""
    tallies = []
    for trial in range(20):
        out, go = tmp_path / f"run{trial}" / "out", tmp_path / f"go{trial}"
        procs = [
            subprocess.Popen([sys.executable, "-c", CONTENDER, str(out), str(go)], stdout=subprocess.PIPE, text=True)
            for _ in range(2)
        ]
        assert all(p.stdout.readline().strip() == "ready" for p in procs)
        go.touch()
        said = sorted(p.communicate(timeout=30)[0].strip() for p in procs)
        tallies.append(said[1] == "won" and said[0].startswith("refused:"))
        assert said[0] == (
            f"refused: logger.output_dir: {out} is being written by another rlcore run right now; wait for it to "
            f"end, or write this run to a fresh directory (-o logger.output_dir={out}-new)"
        ), said
    assert tallies == [True] * 20


def test_a_held_directory_lets_go_when_its_run_ends_however(tmp_path: Path) -> None:
    from rlcore.run.ownership import OutputDirLock

    out = tmp_path / "out"
    holder = subprocess.Popen(
        [sys.executable, "-c", CONTENDER.replace("time.sleep(0.5)", "time.sleep(600)"), str(out), str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "ready" and holder.stdout.readline().strip() == "won"
    with pytest.raises(OutputDirTaken, match="is being written by another rlcore run right now"):
        OutputDirLock(out)
    holder.kill()  # SIGKILL: no cleanup runs, the kernel drops the lock with the process
    holder.wait()
    with OutputDirLock(out) as lock:
        assert lock.path == out
    assert sorted(p.name for p in out.iterdir()) == []  # the hold leaves no file behind


def test_rlcore_run_into_a_directory_another_run_holds_is_one_line_before_ray(
    tmp_path: Path, tiny_model_dir: str
) -> None:
    from rlcore.run.ownership import OutputDirLock

    chat, _ = data_files(tmp_path)
    out = tmp_path / "held"
    with OutputDirLock(out):
        proc, took = rlcore_without_ray(
            tmp_path,
            str(REPO / "examples" / "sft_tiny.yaml"),
            "-o",
            f"logger.output_dir={out}",
            "-o",
            f"policy.model_name={tiny_model_dir}",
        )
    lines = [ln for ln in proc.stderr.splitlines() if not ln.startswith(("notice:", "ignored:"))]
    assert proc.returncode == 1, proc.stderr
    assert lines == [
        f"logger.output_dir: {out} is being written by another rlcore run right now; wait for it to end, or "
        f"write this run to a fresh directory (-o logger.output_dir={out}-new)"
    ], proc.stderr
    assert took < BEFORE_RAY_S, took
    assert list(out.iterdir()) == []
