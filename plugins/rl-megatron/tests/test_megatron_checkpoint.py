"""Megatron distributed checkpoints: resume equals uninterrupted training, also across a TP change; atomic saves.

Adam with weight decay, lr warm-up and gradient clipping, so the optimizer
state and the scheduler matter. A TP=2 policy trains two steps, saving after
the first. Restored from that checkpoint:

- at TP=2, the second step is bit-identical to the uninterrupted one;
- at TP=1 (weights and Adam moments resharded), the logprobs after step 1 are
  the same (1e-5) and so is step 2's loss; the weights agree to 1e-3 of the
  update (Adam divides by sqrt(v), which turns float32 round-off differences
  between the TP=2 and TP=1 reductions into relative update differences of
  ~1e-4 on near-zero gradient entries);
- given only the weights (a fresh optimizer), the second step differs: the
  control that makes the comparisons meaningful.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch
from megatron_helpers import batch, max_valid_diff, model_dir, policy_config, state_of

from rlcore.testing.conformance import weight_problems

pytest_plugins = ["rlcore.testing.pytest_plugin"]
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

ADAM = {
    "optimizer": {"optimizer": "adam", "weight_decay": 0.01},
    "scheduler": {"start_weight_decay": 0.01, "end_weight_decay": 0.01, "lr_warmup_iters": 1, "lr_warmup_init": 1e-3},
}
LR = 1e-2


def _config(path: str, world: int, tp: int) -> Any:
    return policy_config(path, world, lr=LR, max_grad_norm=1.0, megatron={**ADAM, "tensor_model_parallel_size": tp})


@pytest.fixture(scope="module")
def runs(ray_session: None, tiny_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> dict:
    from rlcore.algorithms.loss_functions import NLLLoss
    from rlcore.policy import Policy
    from rlcore.testing.pytest_plugin import ClusterPool

    path = model_dir("llama")
    root = tmp_path_factory.mktemp("resume")
    first, second = batch(tiny_tokenizer, seed=21), batch(tiny_tokenizer, seed=22)
    probe = batch(tiny_tokenizer, seed=23)
    clusters = ClusterPool()
    out: dict[str, Any] = {"probe": probe}
    try:
        straight = Policy(
            clusters(2), _config(path, 2, 2), tiny_tokenizer, name_prefix="resume-straight", init_reference_model=False
        )
        out["step1"] = straight.train(first, NLLLoss())
        straight.save_checkpoint(str(root / "w1"), str(root / "o1"))
        out["after_step1"] = straight.get_logprobs(probe)["logprobs"]
        out["step2"] = straight.train(second, NLLLoss())
        straight.save_checkpoint(str(root / "w2"))
        straight.shutdown()

        same = Policy(
            clusters(2),
            _config(path, 2, 2),
            tiny_tokenizer,
            name_prefix="resume-same-layout",
            optimizer_path=str(root / "o1"),
            init_reference_model=False,
        )
        out["same_step2"] = same.train(second, NLLLoss())
        same.save_checkpoint(str(root / "w2-same"))
        same.shutdown()

        resumed = Policy(
            clusters(1),
            _config(path, 1, 1),
            tiny_tokenizer,
            name_prefix="resume-resumed",
            weights_path=str(root / "w1"),
            optimizer_path=str(root / "o1"),
            init_reference_model=False,
        )
        out["resumed_after_step1"] = resumed.get_logprobs(probe)["logprobs"]
        out["resumed_step2"] = resumed.train(second, NLLLoss())
        resumed.save_checkpoint(str(root / "w2-resumed"))
        resumed.shutdown()

        fresh = Policy(
            clusters(1),
            _config(path, 1, 1),
            tiny_tokenizer,
            name_prefix="resume-fresh",
            weights_path=str(root / "w1"),
            init_reference_model=False,
        )
        fresh.train(second, NLLLoss())
        fresh.save_checkpoint(str(root / "w2-fresh"))
        fresh.shutdown()
    finally:
        clusters.shutdown()
    out.update({name: state_of(str(root / name)) for name in ("w1", "w2", "w2-same", "w2-resumed", "w2-fresh")})
    return out


def test_tp2_checkpoint_loads_at_tp1_with_the_same_logprobs(runs: dict) -> None:
    lengths = runs["probe"]["input_lengths"]
    assert max_valid_diff(runs["resumed_after_step1"], runs["after_step1"], lengths) <= 1e-5


def test_resume_equals_uninterrupted_training(runs: dict) -> None:
    """Same layout: the resumed second step is bit-identical (loss, grad norm, every weight)."""
    assert runs["same_step2"]["loss"].tolist() == runs["step2"]["loss"].tolist()
    assert runs["same_step2"]["grad_norm"].tolist() == runs["step2"]["grad_norm"].tolist()
    for name, tensor in runs["w2"].items():
        assert torch.equal(runs["w2-same"][name], tensor), name


def test_resume_at_another_tensor_parallel_size(runs: dict) -> None:
    expected, got = float(runs["step2"]["loss"][0]), float(runs["resumed_step2"]["loss"][0])
    assert abs(got - expected) <= 1e-5 * abs(expected), (got, expected)
    assert abs(float(runs["resumed_step2"]["grad_norm"][0]) - float(runs["step2"]["grad_norm"][0])) <= 1e-5
    problems = weight_problems(runs["w2-resumed"], runs["w2"], runs["w1"], 1e-3, "TP=1 resumed vs TP=2")
    assert not problems, "\n".join(problems)


def test_without_the_optimizer_state_training_differs(runs: dict) -> None:
    """The control: a fresh Adam state gives a visibly different second step."""
    problems = weight_problems(runs["w2-fresh"], runs["w2"], runs["w1"], 1e-2, "fresh optimizer vs resumed")
    assert problems, "a fresh optimizer gave the same step: the resume comparison would be vacuous"


_ATOMIC = textwrap.dedent(r"""
    import json, os, sys, warnings
    warnings.filterwarnings("ignore")
    import torch, torch.distributed as dist
    root = sys.argv[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    from rl_megatron import checkpointing, cpu_compat
    cpu_compat.apply()
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    def state(value):
        return {"w": ShardedTensor.from_rank_offsets("w", torch.full((4,), float(value)))}

    def read(path):
        checkpointing.read_info(path)
        return checkpointing.load(state(0), path)["w"].tolist()

    path = os.path.join(root, "ckpt")
    checkpointing.save(state(1), path, {"version": 1})
    out = {"first": read(path)}

    real_save = dist_checkpointing.save
    def crash_mid_save(sharded_state, directory, *args, **kwargs):
        real_save(sharded_state, directory, *args, **kwargs)  # the shards are written ...
        raise RuntimeError("killed mid-save")                  # ... but the save never completes
    dist_checkpointing.save = crash_mid_save
    try:
        checkpointing.save(state(2), path, {"version": 2})
    except RuntimeError as exc:
        out["error"] = str(exc)
    dist_checkpointing.save = real_save
    out["after_crash"] = read(path)
    out["leftovers"] = sorted(n for n in os.listdir(root) if n != "ckpt")

    checkpointing.save(state(3), path, {"version": 3})
    # A crash between the two publish renames: the new checkpoint was never renamed in.
    os.rename(path, os.path.join(root, ".ckpt.old"))
    out["recovered"] = read(path)
    out["info"] = json.loads(open(os.path.join(path, checkpointing.INFO_NAME)).read())
    dist.destroy_process_group()
    print(json.dumps(out))
""")


def test_a_crash_mid_save_leaves_the_previous_checkpoint_whole(tmp_path: Any) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    proc = subprocess.run(
        [sys.executable, "-c", _ATOMIC, str(tmp_path), port],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["first"] == [1.0] * 4
    assert out["error"] == "killed mid-save"
    assert out["after_crash"] == [1.0] * 4, "the interrupted save replaced the previous checkpoint"
    assert out["leftovers"] == [], f"the interrupted save left {out['leftovers']}"
    assert out["recovered"] == [3.0] * 4 and out["info"] == {"version": 3}
