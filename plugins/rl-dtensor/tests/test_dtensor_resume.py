"""Save → load → continue equals uninterrupted training, with state that must round-trip.

AdamW (moments and step counts), a warm-up scheduler chained to a decay by a
milestone (the learning rate of the step after the save depends on the
scheduler's state), gradient clipping, bfloat16 compute over float32 master
weights, dp=2 — and the resumed run starts in a new ``Policy`` from the saved
paths. Both runs are deterministic, so they agree to float round-off.
"""

from __future__ import annotations

import pytest
import torch
from dtensor_testlib import batch as make_data
from dtensor_testlib import call_all, full_weights, max_abs_diff, model_dir, policy_config

from rlcore.algorithms.loss_functions import NLLLoss

SETTINGS = dict(
    precision="bfloat16",
    max_grad_norm=1.0,
    optimizer={"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-2, "weight_decay": 0.01}},
    scheduler=[
        {"name": "torch.optim.lr_scheduler.LinearLR", "kwargs": {"start_factor": 0.1, "total_iters": 2}},
        {"name": "torch.optim.lr_scheduler.ExponentialLR", "kwargs": {"gamma": 0.5}},
        {"name": "milestones", "milestones": [2]},
    ],
)


@pytest.fixture(scope="module")
def setup(ray_session, tiny_tokenizer, tmp_path_factory):
    from rlcore.distributed import RayVirtualCluster
    from rlcore.policy import Policy

    path = model_dir("llama")
    cfg = policy_config(path, **SETTINGS)
    cluster = RayVirtualCluster([2])
    steps = [make_data(tiny_tokenizer, seed=s) for s in (1, 2, 3)]
    ckpt = tmp_path_factory.mktemp("resume")
    started = []

    def start(**kwargs):
        policy = Policy(cluster, cfg, tiny_tokenizer, name_prefix=f"dt-resume{len(started)}", **kwargs)
        started.append(policy)
        return policy

    yield start, steps, ckpt
    for policy in started:
        policy.shutdown()
    cluster.shutdown()


def test_save_load_continue_equals_uninterrupted(setup):
    start, steps, ckpt = setup
    weights, optim = ckpt / "weights", ckpt / "optim"

    first = start()
    first.train(steps[0], NLLLoss())
    first.save_checkpoint(str(weights), str(optim))
    first.save_checkpoint(str(weights), str(optim))  # overwriting a checkpoint is atomic too
    saved_state = call_all(first, "optimizer_summary")
    assert sorted(p.name for p in ckpt.iterdir()) == ["optim", "weights"], "temporary directories left behind"
    uninterrupted = [float(first.train(data, NLLLoss())["loss"][0]) for data in steps[1:]]
    expected = full_weights(first)
    first.shutdown()

    resumed = start(weights_path=str(weights), optimizer_path=str(optim))
    # Each rank's optimizer shards, step counts and learning rate came back (not a fresh AdamW).
    assert call_all(resumed, "optimizer_summary") == saved_state
    assert saved_state[0]["steps"] == [1] and saved_state[0]["moments"] > 0
    continued = [float(resumed.train(data, NLLLoss())["loss"][0]) for data in steps[1:]]
    got = full_weights(resumed)

    assert continued == pytest.approx(uninterrupted, rel=1e-6, abs=1e-6)
    worst, name = max_abs_diff(got, expected)
    assert worst <= 1e-6, f"resumed training differs from uninterrupted at {name} by {worst:.3g}"
    # float32 master weights even though the compute dtype is bfloat16; refit sends the compute dtype
    assert all(t.dtype == torch.float32 for t in got.values())
    assert {dtype for _, dtype in resumed.prepare_refit_info().values()} == {"bfloat16"}
