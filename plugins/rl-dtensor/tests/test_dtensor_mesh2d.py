"""FSDP2 x TP on a 2-D (dp=2, tp=2) mesh: four ranks, the layout where both kinds of sharding meet.

Only here do FSDP's strided shards of TP-sharded weights appear, so only here
can a gradient norm that counts them as replicas, a gather that misses one
axis, or an optimizer state that DCP cannot put back show up. Slow-marked: it
starts four workers on the shared 2-core machine.
"""

from __future__ import annotations

import pytest
from dtensor_testlib import batch as make_data
from dtensor_testlib import (
    batching,
    call_all,
    full_weights,
    hf_logprobs,
    max_abs_diff,
    model_dir,
    oracle_clipped_step,
    policy_config,
    valid_diff,
)

from rlcore.algorithms.loss_functions import NLLLoss

pytestmark = pytest.mark.slow
TOL = 1e-5


@pytest.fixture(scope="module")
def mesh2d(ray_session, tiny_tokenizer):
    from rlcore.distributed import RayVirtualCluster
    from rlcore.policy import Policy

    path = model_dir("llama")
    cfg = policy_config(
        path,
        world=4,
        tp=2,
        sp=True,
        max_grad_norm=1.0,
        optimizer={"name": "torch.optim.SGD", "kwargs": {"lr": 0.5, "momentum": 0.9}},
    )
    cluster = RayVirtualCluster([4])
    policy = Policy(cluster, cfg, tiny_tokenizer, name_prefix="dt-2d")
    yield path, policy
    policy.shutdown()
    cluster.shutdown()


def test_two_dimensional_mesh(mesh2d, tiny_tokenizer, tmp_path):
    path, policy = mesh2d
    assert set(call_all(policy, "is_dtensor_model")[0].values()) == {2}
    data = make_data(tiny_tokenizer)
    for mode in ("plain", "packing"):
        with batching(policy, mode):
            got = policy.get_logprobs(data)["logprobs"]
        assert valid_diff(got, hf_logprobs(path, data), data["input_lengths"]) <= TOL, mode

    # A clipped step (the first momentum-SGD step is a plain SGD step) equals the single-process one.
    expected = oracle_clipped_step(path, data, NLLLoss(), 1.0)
    out = policy.train(data, NLLLoss())
    assert abs(float(out["grad_norm"][0]) - expected.grad_norm) <= TOL * expected.grad_norm
    assert abs(float(out["loss"][0]) - expected.loss) <= TOL * max(1.0, expected.loss)
    worst, name = max_abs_diff(full_weights(policy), expected.weights)
    assert worst <= TOL, f"{name} differs by {worst:.3g}"

    # Save (weights + sharded momentum), step, load, step again: the same weights.
    weights, optim = tmp_path / "w", tmp_path / "o"
    policy.save_checkpoint(str(weights), str(optim))
    second = make_data(tiny_tokenizer, seed=9)
    policy.train(second, NLLLoss())
    after = full_weights(policy)
    call_all(policy, "load_checkpoint", str(weights), str(optim))
    policy.train(second, NLLLoss())
    worst, name = max_abs_diff(full_weights(policy), after)
    assert worst <= 1e-6, f"{name} differs after reloading the checkpoint by {worst:.3g}"
