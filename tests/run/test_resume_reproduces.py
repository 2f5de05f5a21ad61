"""A resumed run reproduces the uninterrupted one, bit for bit on CPU (issue 52 item 4; docs/reproducibility.md).

Each comparison trains a run without interruption, checkpointing after every step, then makes the run that was
interrupted after step ``k``: its output directory as a kill right after step ``k``'s checkpoint left it (that
checkpoint published, the later ones and their metrics rows never written), resumed with ``--resume``'s
:func:`rlcore.run.train.train`. The reference is the uninterrupted run itself: every metrics row of the resumed
run equals its row, value for value (the fields in :data:`WALL_CLOCK` dropped: they measure time and memory,
not the training), and the final checkpoint's ``weights/model.safetensors`` is the same bytes.

GRPO's completions come from the per-request sampling seeds (``sampling_seeds``) the engines honour; training's
randomness from generators seeded by the optimizer step (:func:`rlcore.training.worker_base.training_random_state`).
Without them, every re-run step differed (the issue: 4 of 4).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from rlcore.config import load_config
from tests.support.runs import ONE_WORKER, short_run_config

#: Metrics that measure the machine, not the training (wall-clock seconds, throughput, peak memory): dropped
#: from both runs' rows before they are compared. Everything else is compared exactly.
WALL_CLOCK_PREFIXES = ("time/", "memory/")
WALL_CLOCK = ("tokens_per_s",)

#: Checkpoints after every step, all kept (the interrupted run is cut from the uninterrupted one); no bar.
EVERY_STEP = {"checkpointing.save_every_n_steps": "1", "checkpointing.keep_last": "10", "logger.progress_bar": "false"}


def training_rows(out: Path, also_dropped: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """The run's metrics rows without the wall-clock fields (and ``also_dropped``)."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    dropped = (*WALL_CLOCK, *also_dropped)
    return [{k: v for k, v in r.items() if not k.startswith(WALL_CLOCK_PREFIXES) and k not in dropped} for r in rows]


def weights_digest(out: Path, step: int) -> str:
    return hashlib.sha256((out / "checkpoints" / f"step_{step:06d}" / "weights" / "model.safetensors").read_bytes())


def interrupted_after(whole: Path, step: int, out: Path) -> Path:
    """``out``: the output directory of the run ``whole`` as a kill right after step ``step``'s checkpoint left
    it (the later checkpoints and metrics rows never written)."""
    shutil.copytree(whole, out)
    for later in (out / "checkpoints").glob("step_*"):
        if int(later.name.removeprefix("step_")) > step:
            shutil.rmtree(later)
    rows = (out / "metrics.jsonl").read_text().splitlines()
    (out / "metrics.jsonl").write_text("".join(r + "\n" for r in rows if json.loads(r)["step"] <= step))
    return out


def assert_resume_reproduces(
    make_config: Any, tmp_path: Path, steps: int, interrupted_at: int, work_done: tuple[str, ...] = ()
) -> None:
    """Train ``make_config(out)`` for ``steps`` steps uninterrupted and resumed after step ``interrupted_at``;
    the metrics rows (without :data:`WALL_CLOCK` and ``work_done``: counts of work a resumed run legitimately
    does again) and the final weights must be identical."""
    from rlcore.run.train import train

    whole = tmp_path / "whole"
    train(make_config(whole))
    resumed = interrupted_after(whole, interrupted_at, tmp_path / "resumed")
    train(make_config(resumed), resume=True)
    expected, got = training_rows(whole, work_done), training_rows(resumed, work_done)
    assert [r["step"] for r in expected if r["step"] >= 0][-1] == steps - 1
    assert len(got) == len(expected)
    for want, row in zip(expected, got):
        assert row == want, f"step {want['step']}: " + ", ".join(
            f"{k}: {want.get(k)} != {row.get(k)}" for k in sorted(set(want) | set(row)) if want.get(k) != row.get(k)
        )
    last = steps - 1
    assert weights_digest(resumed, last).hexdigest() == weights_digest(whole, last).hexdigest()


def test_grpo_resumed_after_a_step_reproduces_the_uninterrupted_run(ray_session, tmp_path):
    """Synchronous GRPO, generation colocated with training (one fsdp1 worker trains and samples, HF generate
    with a generator per request): resumed after step 0, steps 1 and 2 are re-run."""

    def config(out: Path) -> Any:
        return short_run_config(out, 3, **ONE_WORKER, **EVERY_STEP)

    assert_resume_reproduces(config, tmp_path, steps=3, interrupted_at=0)


def vllm_missing() -> bool:
    from rlcore.plugins import get_registry

    return {r.name: r.status for r in get_registry().records}.get("vllm") != "ok"


@pytest.mark.slow  # two runs with vLLM engines: 231 s on the shared 2-core machine (2026-11-29)
@pytest.mark.skipif(vllm_missing(), reason="needs rl-vllm")
def test_grpo_with_colocated_vllm_engines_resumed_reproduces_the_uninterrupted_run(ray_session, tmp_path):
    """examples/grpo_tiny.yaml's layout: training ranks and vLLM engines share the bundles, refit after each step."""

    def config(out: Path) -> Any:
        return short_run_config(out, 3, **EVERY_STEP)

    assert_resume_reproduces(config, tmp_path, steps=3, interrupted_at=0)


@pytest.mark.slow  # two runs with a vLLM engine: 190 s on the shared 2-core machine (2026-11-29)
@pytest.mark.skipif(vllm_missing(), reason="needs rl-vllm")
def test_async_grpo_resumed_reproduces_the_uninterrupted_run(ray_session, tmp_path):
    """examples/grpo_async_tiny.yaml: the rollout of step 1 was generated from the weights of step 0 while step 0
    trained; the checkpoint after step 0 carries it, and the resumed run trains on it. ``refit_bytes`` is dropped:
    the resumed run's first step also counts the refit that loads its engine."""

    def config(out: Path) -> Any:
        return load_config(
            "examples/grpo_async_tiny.yaml",
            ["policy.backend=reference", "grpo.max_num_steps=3", f"logger.output_dir={out}"]
            + [f"{k}={v}" for k, v in EVERY_STEP.items()],
        )

    assert_resume_reproduces(config, tmp_path, steps=3, interrupted_at=0, work_done=("refit_bytes",))


def sft_or_dpo_config(example: str, section: str, out: Path, steps: int) -> Any:
    """An example's tiny SFT or DPO run on one fsdp1 worker, validated every other step."""
    return load_config(
        f"examples/{example}",
        [
            f"logger.output_dir={out}",
            "policy.backend=fsdp1",
            "cluster.workers_per_node=1",
            f"{section}.max_num_steps={steps}",
            f"{section}.val_period=2",
            f"{section}.val_global_batch_size=8",
            f"{section}.val_micro_batch_size=4",
            "checkpointing.metric_name=null",
            *(f"{k}={v}" for k, v in EVERY_STEP.items()),
        ],
    )


@pytest.mark.parametrize(("example", "section"), [("sft_tiny.yaml", "sft"), ("dpo_tiny.yaml", "dpo")])
def test_sft_and_dpo_resumed_after_a_step_reproduce_the_uninterrupted_run(ray_session, tmp_path, example, section):
    """Resumed after step 0 (the data order of the shuffled epoch, validation at step 1, the weights)."""
    assert_resume_reproduces(lambda out: sft_or_dpo_config(example, section, out, 3), tmp_path, 3, interrupted_at=0)


def test_training_randomness_is_a_function_of_the_step_and_rank_and_leaves_the_process_generator_alone():
    """What a resumed run relies on for dropout: the draws inside the block depend on (steps taken, rank) only,
    not on what the process drew before; torch's own generator continues after the block as if it had not run."""
    import torch

    from rlcore.training.worker_base import optimizer_steps_taken, training_random_state

    cpu = torch.device("cpu")

    def draws(steps: int | None, rank: int) -> torch.Tensor:
        with training_random_state(steps, rank, cpu):
            return torch.nn.functional.dropout(torch.ones(64), p=0.5, training=True)

    torch.manual_seed(1)
    first = draws(7, 0)
    torch.rand(1000)  # whatever the process drew since
    assert torch.equal(draws(7, 0), first)
    assert not torch.equal(draws(8, 0), first) and not torch.equal(draws(7, 1), first)
    torch.manual_seed(2)
    expected = torch.rand(4)
    torch.manual_seed(2)
    draws(7, 0)
    assert torch.equal(torch.rand(4), expected)  # the process's generator is where it was
    torch.manual_seed(3)
    unseeded = draws(None, 0)
    torch.manual_seed(3)
    assert torch.equal(torch.nn.functional.dropout(torch.ones(64), p=0.5, training=True), unseeded)

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    for _ in range(3):
        optimizer.step()
        scheduler.step()
    assert optimizer_steps_taken(scheduler) == 3 and optimizer_steps_taken(None) is None


def test_rollouts_carried_by_a_checkpoint_come_back_bit_for_bit(tmp_path):
    """What an asynchronous run's checkpoint carries (its rollouts generated ahead): every tensor of every dtype
    a rollout holds and its metrics, read back through safetensors (no pickle: a checkpoint is untrusted)."""
    import torch

    from rlcore.data import BatchedDataDict
    from rlcore.run.checkpoints import ROLLOUTS, load_rollouts, save_rollouts
    from rlcore.run.rollouts import Rollout

    generator = torch.Generator().manual_seed(0)
    data = BatchedDataDict(
        output_ids=torch.randint(0, 100, (4, 9), generator=generator),
        logprobs=-torch.rand(4, 9, generator=generator),
        truncated=torch.tensor([True, False, False, True]),
        generation_window=torch.rand(4, 2, generator=generator, dtype=torch.float64),
    )
    carried = {3: Rollout(data, torch.rand(4, generator=generator), {"env/errors": 0.0, "env/first_error": "row 2"})}
    assert load_rollouts(tmp_path) == {}  # a checkpoint without any
    save_rollouts(tmp_path / ROLLOUTS, carried)
    back = load_rollouts(tmp_path)
    assert list(back) == [3] and back[3].metrics == carried[3].metrics
    assert torch.equal(back[3].rewards, carried[3].rewards)
    assert sorted(back[3].data) == sorted(data)
    for key, value in data.items():
        assert back[3].data[key].dtype == value.dtype and torch.equal(back[3].data[key], value), key


def test_sampling_seeds_are_a_pure_function_of_the_request():
    from rlcore.run.rollouts import sampling_seed

    seeds = {
        sampling_seed(0, step, row, copy, turn)
        for step in (None, 0, 1)
        for row in range(8)
        for copy in range(4)
        for turn in range(2)
    }
    assert len(seeds) == 3 * 8 * 4 * 2 and all(0 <= s < 2**63 for s in seeds)  # distinct, and an int64 each
    assert sampling_seed(0, 5, 3, 1, 0) == sampling_seed(0, 5, 3, 1, 0) != sampling_seed(1, 5, 3, 1, 0)
