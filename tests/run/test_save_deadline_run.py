"""A real run stopped by ``checkpointing.checkpoint_must_save_by``: the step at the limit is saved and the run ends
cleanly there, as NeMo-RL's loops do (the decision itself is checked against NeMo-RL's in test_save_deadline.py).

A limit of 00:00:00:00 is due after the first step whatever the machine's speed: NeMo-RL's TimeoutChecker saves
then (elapsed + mean step >= 0)."""

from __future__ import annotations

import json

from rlcore.run.checkpoints import complete_steps, step_dir
from rlcore.run.train import train
from tests.support.runs import ONE_WORKER, short_run_config


def test_the_run_saves_the_step_at_its_limit_and_stops_there(ray_session, tmp_path):
    config = short_run_config(
        tmp_path / "out",
        3,
        **{"checkpointing.save_every_n_steps": "10", "checkpointing.checkpoint_must_save_by": "00:00:00:00"},
        **ONE_WORKER,
    )
    summary = train(config)
    assert "checkpoint_must_save_by=00:00:00:00" in summary["ended_early"] and "after step 0" in summary["ended_early"]
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert sorted({r["step"] for r in rows if r["step"] >= 0}) == [0]  # steps 1 and 2 never ran
    assert complete_steps(tmp_path / "out" / "checkpoints") == [0]  # saved although the period is 10
    assert summary["final_weights"] == str(step_dir(tmp_path / "out" / "checkpoints", 0) / "weights")
    assert not (tmp_path / "out" / "summary.json").exists()  # to be resumed: not finished (policy.warm_start)
