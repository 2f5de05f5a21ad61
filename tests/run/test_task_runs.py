"""Real runs on a user's task: a JSONL dataset, an environment that reads each row's metadata, validation, epochs,
and a resumed run that continues the dataset exactly where the interrupted one stopped."""

from __future__ import annotations

import json

import pytest

from tests.support.runs import ONE_WORKER, short_run_config

#: (phase, sample id) of every completion the reward function scored, in order: the test's record of the data.
SEEN: list[tuple[str, str]] = []


def id_parity_reward(prompts, completions, metadata):
    """1 for an even-length completion; records which samples it scored (training batches have 8 completions)."""
    phase = "train" if len(completions) == 8 else "validation"
    SEEN.extend((phase, m["id"]) for m in metadata)
    assert all(m["ground_truth"] == m["answer"] for m in metadata)
    return [float(len(c) % 2 == 0) for c in completions]


def _task_config(tmp_path, out, steps, **extra):
    rows = [{"id": f"s{i}", "question": f"count {i}", "answer": str(i)} for i in range(12)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:5]))
    return short_run_config(
        out,
        steps,
        **{
            "data.train.path": str(tmp_path / "train.jsonl"),
            "data.validation.path": str(tmp_path / "val.jsonl"),
            "data.input_key": "question",
            "data.output_key": "answer",
            "data.system_prompt": "Be brief.",
            "env.name": "python",
            "env.python_cfg.reward": "tests.run.test_task_runs:id_parity_reward",
            "grpo.num_prompts_per_step": "4",
            "grpo.num_generations_per_prompt": "2",
            "grpo.max_num_epochs": "2",
            "grpo.val_period": "3",
            "grpo.val_at_start": "true",
            "grpo.max_val_samples": "4",
            "grpo.val_batch_size": "3",
            "policy.train_global_batch_size": "8",
            "policy.train_micro_batch_size": "4",
            "policy.logprob_batch_size": "8",
            "checkpointing.save_every_n_steps": "3",
            **ONE_WORKER,
            **extra,
        },
    )


def test_a_dataset_run_validates_and_resumes_on_the_next_unseen_batch(ray_session, tmp_path):
    from rlcore.run.train import train

    SEEN.clear()
    whole = train(_task_config(tmp_path, tmp_path / "whole", 20, **{"checkpointing.enabled": "false"}))
    uninterrupted = list(SEEN)
    rows = [json.loads(line) for line in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    # 12 rows, 4 per step, 2 epochs: 6 steps although max_num_steps is 20
    assert whole["steps"] == 6 and [r["step"] for r in rows] == [-1, 0, 1, 2, 3, 4, 5]
    assert [r.get("epoch") for r in rows[1:]] == [0, 0, 0, 1, 1, 1]
    validated = {r["step"]: r["validation/num_samples"] for r in rows if "validation/accuracy" in r}
    assert validated == {-1: 4.0, 2: 4.0, 5: 4.0}  # at start, then after every 3rd step; max_val_samples=4
    train_ids = [i for phase, i in uninterrupted if phase == "train"]
    epochs = [set(train_ids[:24]), set(train_ids[24:])]  # 3 steps x 4 prompts x 2 completions per epoch
    assert epochs[0] == epochs[1] == {f"s{i}" for i in range(12)}
    assert train_ids[:24] != train_ids[24:]  # reshuffled
    assert [i for phase, i in uninterrupted if phase == "validation"] == [f"s{i}" for i in range(4)] * 3

    SEEN.clear()
    best = {"checkpointing.metric_name": "validation/accuracy", "checkpointing.keep_last": "1"}
    train(_task_config(tmp_path, tmp_path / "resumed", 3, **best))  # stopped after step 2 (a checkpoint at step 2)
    train(_task_config(tmp_path, tmp_path / "resumed", 20, **best), resume=True)
    assert [i for phase, i in SEEN if phase == "train"] == train_ids
    state = json.loads((tmp_path / "resumed" / "checkpoints" / "step_000005" / "state.json").read_text())
    assert state["data"] == {"next_batch": 6, "epoch": 2, "batch_size": 4, "num_samples": 12, "seed": 0}
    resumed_rows = [json.loads(line) for line in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    accuracy = {r["step"]: r["validation/accuracy"] for r in resumed_rows if "validation/accuracy" in r}
    assert state["metrics"] == {"validation/accuracy": accuracy[5]}
    # keep_last 1 by accuracy: the better of steps 2 and 5 (ties: 5), and step 5 as the newest
    kept = sorted(p.name for p in (tmp_path / "resumed" / "checkpoints").glob("step_*"))
    assert kept == (["step_000002", "step_000005"] if accuracy[2] > accuracy[5] else ["step_000005"])

    with pytest.raises(
        ValueError,
        match=r"--resume: .*step_000005 continued a different data stream \(batch_size "
        r"4 -> 2\)",
    ):
        train(
            _task_config(
                tmp_path,
                tmp_path / "resumed",
                20,
                **{"grpo.num_prompts_per_step": "2", "grpo.num_generations_per_prompt": "4"},
            ),
            resume=True,
        )


def test_checkpoints_kept_by_a_metric_follow_nemo_rl(tmp_path):
    """keep_top_k by metric_name: the best k (ties: the newer), the newest always (to resume from)."""
    from rlcore.run.checkpoints import kept
    from rlcore.run.train import ranking_metric

    values = {1: 0.5, 3: 0.9, 5: 0.5, 7: 0.2, 9: None}  # step 9 saved without a validation
    checkpoints = [
        (tmp_path / f"s{s}", {"step": s, **({"metrics": {"validation/accuracy": v}} if v is not None else {})})
        for s, v in values.items()
    ]
    names = lambda keep: sorted(p.name for p in keep)  # noqa: E731
    assert names(kept(checkpoints, 2, ("validation/accuracy", True))) == ["s3", "s5", "s9"]
    assert names(kept(checkpoints, 2, ("validation/accuracy", False))) == ["s5", "s7", "s9"]  # 0.5 tie: newer
    assert names(kept(checkpoints, 2)) == ["s7", "s9"]
    assert ranking_metric("validation/accuracy", {"loss": 1.0}) == {}
    with pytest.raises(
        ValueError, match="'validation/acuracy' is not a metric of this run; it has loss, validation/accuracy"
    ):
        ranking_metric("validation/acuracy", {"loss": 1.0, "validation/accuracy": 0.5, "time/step_s": 1.0})


def flat_or_differing_reward(prompts, completions, metadata):
    """Dynamic sampling's task: a row whose number is a multiple of 3 scores 1 for every completion (its groups
    have no signal); any other row's two completions score 0 and 1 (signal). Records the samples scored."""
    phase = "train" if len(completions) == 6 else "validation"  # 3 prompts x 2 completions per generation batch
    SEEN.extend((phase, m["id"]) for m in metadata)
    return [1.0 if int(m["id"][1:]) % 3 == 0 else float(j % 2) for j, m in enumerate(metadata)]


def _expected_dynamic_steps(batches: list[list[str]], wanted: int) -> list[dict[str, float]]:
    """What each step of dynamic sampling should do with these generation batches (ids per batch): the steps
    the data completes, each with its batches, surplus and all generated rewards."""
    steps, step = [], {"batches": 0, "found": 0, "rewards": []}
    for ids in batches:
        groups = list(dict.fromkeys(ids))  # the batch's prompts, each generated twice
        step["batches"] += 1
        step["rewards"] += [1.0 if int(i[1:]) % 3 == 0 else r for i in groups for r in (0.0, 1.0)]
        step["found"] += sum(int(i[1:]) % 3 != 0 for i in groups)
        if step["found"] >= wanted:
            steps.append(step)
            step = {"batches": 0, "found": 0, "rewards": []}
    return steps


def test_dynamic_sampling_trains_on_groups_with_signal_resumes_and_ends_with_the_data(ray_session, tmp_path):
    """12 rows, 2 prompts per step from batches of 3 (batch_multiplier 1.5), 2 epochs: 8 generation batches, and
    each step draws as many as it needs to hold 2 groups whose rewards differ."""
    from rlcore.run.train import train

    def config(out, steps, **extra):
        return _task_config(
            tmp_path,
            tmp_path / out,
            steps,
            **{
                "env.python_cfg.reward": "tests.run.test_task_runs:flat_or_differing_reward",
                "grpo.use_dynamic_sampling": "true",
                "grpo.batch_multiplier": "1.5",
                "grpo.num_prompts_per_step": "2",
                "grpo.val_period": "0",
                "grpo.val_at_start": "false",
                "grpo.val_at_end": "true",
                "grpo.max_val_samples": "2",
                "grpo.val_batch_size": "2",
                "policy.train_global_batch_size": "4",
                "policy.train_micro_batch_size": "2",
                "policy.logprob_batch_size": "4",
                "checkpointing.save_every_n_steps": "100",
                "grpo.seed": "11",  # its shuffle: step 1 draws 2 batches, and the last batch leaves a step unfinished
                **extra,
            },
        )

    SEEN.clear()
    whole = train(config("whole", 20))
    train_ids = [i for phase, i in SEEN if phase == "train"]
    batches = [train_ids[k : k + 6] for k in range(0, len(train_ids), 6)]
    assert len(batches) == 8  # every batch the 2 epochs allow was drawn, then the data ran out inside a step
    expected = _expected_dynamic_steps(batches, 2)
    rows = [json.loads(line) for line in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "reward_mean" in r]
    assert expected[1]["batches"] == 2 and sum(s["batches"] for s in expected) < 8  # what seed 11 was chosen for
    assert whole["steps"] == len(expected) == len(trained) and whole["ended_early"].startswith(
        f"the data ran out during step {len(expected)}"
    )
    for row, step in zip(trained, expected):
        assert row["dynamic_sampling/gen_batches"] == step["batches"]
        assert row["dynamic_sampling/discarded_valid_samples"] == 2 * (step["found"] - 2)
        assert row["reward_mean"] == pytest.approx(sum(step["rewards"]) / len(step["rewards"]))
        assert row["filtered_reward_mean"] == 0.5  # only the 0/1 groups are trained
    # the run's end: the last complete step validated (val_at_end) and checkpointed with its data position
    last = len(expected) - 1
    assert [r["step"] for r in rows if "validation/accuracy" in r] == [last]
    state = json.loads((tmp_path / "whole" / "checkpoints" / f"step_{last:06d}" / "state.json").read_text())
    assert state["data"]["next_batch"] == sum(s["batches"] for s in expected)
    assert state["data"]["batch_size"] == 3

    SEEN.clear()
    train(config("resumed", 2))  # stopped after step 1, checkpointed there
    train(config("resumed", 20), resume=True)
    assert [i for phase, i in SEEN if phase == "train"] == train_ids  # the resumed run draws the next unseen batch
