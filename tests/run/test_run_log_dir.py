"""Issue 52 item 10: a run's process logs are one level below its directory, for a NeMo-RL config
(``logger.log_dir: logs``, so ``logger.output_dir: logs``) and an rlcore config alike, never ``logs/logs/``."""

from __future__ import annotations

import os
from pathlib import Path

from rlcore.nemo_rl import load_nemo_rl_config
from rlcore.run.output import quiet_output, run_log_dir

FIXTURES = Path(__file__).parents[1] / "fixtures" / "nemo_rl"


def test_the_process_logs_of_a_nemo_rl_and_an_rlcore_config_are_one_level_down():
    loaded = load_nemo_rl_config(
        FIXTURES / "main" / "grpo_math_1B.yaml", [f"++data.train.data_path={FIXTURES}/math.jsonl"]
    )
    assert loaded.config.logger.output_dir == "logs"  # NeMo-RL's log_dir
    assert run_log_dir(loaded.config.logger.output_dir) == Path("logs")
    assert run_log_dir("runs/latest") == Path("runs/latest/logs")
    assert run_log_dir("/abs/logs") == Path("/abs/logs")


def test_quiet_output_writes_the_driver_log_one_level_down_even_when_given_logs_logs(tmp_path):
    for output_dir, expected in ((tmp_path / "logs", tmp_path / "logs"), (tmp_path / "run", tmp_path / "run" / "logs")):
        with quiet_output(output_dir / "logs"):
            os.write(1, f"a line for {output_dir.name}\n".encode())
        assert (expected / "driver.log").read_text() == f"a line for {output_dir.name}\n"
    assert not (tmp_path / "logs" / "logs").exists()
