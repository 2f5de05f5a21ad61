"""The CUDA path (NCCL, device tensors, CUDA IPC refit): skipped on machines without a GPU.

Never what CI depends on; run on a lent GPU machine with ``pytest plugins/rl-dtensor -m gpu``.
"""

from __future__ import annotations

import pytest
import torch
from dtensor_testlib import batch as make_data
from dtensor_testlib import full_weights, hf_logprobs, max_abs_diff, model_dir, oracle_step, policy_config

from rlcore.algorithms.loss_functions import NLLLoss

pytestmark = pytest.mark.gpu


def _gpu_cluster(world: int):
    from rlcore.distributed import RayVirtualCluster, init_ray

    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    init_ray(num_gpus=torch.cuda.device_count())
    return RayVirtualCluster([world], use_gpus=True)


def test_one_gpu_policy_matches_hf(tiny_tokenizer):
    """Logprobs and one SGD step on a GPU equal the float32 HF computation on CPU."""
    from rlcore.policy import Policy

    data = make_data(tiny_tokenizer)
    cluster = _gpu_cluster(1)
    try:
        policy = Policy(cluster, policy_config(model_dir("llama"), world=1, use_gpu=True), tiny_tokenizer,
                        name_prefix="dt-gpu")
        assert policy._all("report_device_id")[0].startswith("cuda")
        got = policy.get_logprobs(data)["logprobs"]
        assert float((got - hf_logprobs(model_dir("llama"), data)).abs().max()) <= 1e-4
        _, expected = oracle_step(model_dir("llama"), data, NLLLoss())
        out = policy.train(data, NLLLoss())
        assert abs(float(out["loss"][0]) - expected.loss) <= 1e-4 * abs(expected.loss)
        worst, name = max_abs_diff(full_weights(policy), expected.weights)
        assert worst <= 1e-4, name
        policy.offload_after_refit()  # weights and optimizer state leave the GPU ...
        policy.prepare_for_training()  # ... and come back
        assert torch.isfinite(policy.train(data, NLLLoss())["loss"]).all()
        policy.shutdown()
    finally:
        cluster.shutdown()


def test_context_parallel_is_refused_clearly_on_gpus(tiny_tokenizer):
    from rlcore.distributed import WorkerError
    from rlcore.policy import Policy

    cluster = _gpu_cluster(2)
    try:
        cfg = policy_config(model_dir("llama"), world=2, use_gpu=True, dtensor_cfg={"context_parallel_size": 2})
        with pytest.raises(WorkerError, match="context_parallel_size=2: context parallel is not implemented"):
            Policy(cluster, cfg, tiny_tokenizer, name_prefix="dt-gpu-cp")
    finally:
        cluster.shutdown()
