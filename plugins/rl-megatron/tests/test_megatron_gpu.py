"""GPU-only checks (skipped without CUDA): megatron on CUDA with no CPU redirects, bf16, memory hooks.

These never run in CI (2 CPU cores); they run on a lent GPU machine.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch

from megatron_helpers import batch, call_workers, hf_logprobs, max_valid_diff, model_dir, policy_config

pytest_plugins = ["rlcore.testing.pytest_plugin"]
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]


def test_float32_on_cuda_matches_hf_without_cpu_redirects(make_cluster: Any, tiny_tokenizer: Any) -> None:
    from rlcore.algorithms.loss_functions import NLLLoss
    from rlcore.policy import Policy

    config = policy_config(model_dir("qwen3"), 1)  # the cluster (use_gpus=True) puts the worker on a GPU
    policy = Policy(make_cluster(1, use_gpus=True), config, tiny_tokenizer, name_prefix="megatron-gpu")
    try:
        assert call_workers(policy, "redirected_call_sites") == [None], "cpu_compat must be inactive on a GPU"
        assert call_workers(policy, "report_device_id")[0].startswith("cuda")
        data = batch(tiny_tokenizer)
        got = policy.get_logprobs(data)["logprobs"]
        assert max_valid_diff(got, hf_logprobs(config.model_name, data), data["input_lengths"]) <= 1e-4
        # The memory hooks around a refit leave training intact.
        policy.offload_before_refit()
        policy.offload_after_refit()
        policy.prepare_for_training()
        result = policy.train(data, NLLLoss())
        assert torch.isfinite(result["loss"]).all() and float(result["grad_norm"][0]) > 0
    finally:
        policy.shutdown()


def test_bf16_mixed_precision_trains(make_cluster: Any, tiny_tokenizer: Any) -> None:
    from rlcore.algorithms.loss_functions import NLLLoss
    from rlcore.policy import Policy

    config = policy_config(model_dir("qwen3"), 1, precision="bfloat16", lr=1e-3,
                           megatron={"optimizer": {"optimizer": "adam", "bf16": True, "params_dtype": "bfloat16"}})
    policy = Policy(make_cluster(1, use_gpus=True), config, tiny_tokenizer, name_prefix="megatron-gpu-bf16")
    try:
        data = batch(tiny_tokenizer)
        before = policy.get_logprobs(data)["logprobs"]
        result = policy.train(data, NLLLoss())
        after = policy.get_logprobs(data)["logprobs"]
        assert torch.isfinite(result["loss"]).all() and not torch.equal(before, after)
        assert policy.prepare_refit_info()["model.embed_tokens.weight"][1] == "bfloat16"
    finally:
        policy.shutdown()


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None,
                    reason="checks the error raised without TransformerEngine")
def test_sequence_parallel_without_transformer_engine_is_a_config_error(make_cluster: Any,
                                                                         tiny_tokenizer: Any) -> None:
    from rlcore.distributed import WorkerError
    from rlcore.policy import Policy

    config = policy_config(model_dir("qwen3"), 1, megatron={"sequence_parallel": True})
    with pytest.raises(WorkerError, match="policy.megatron_cfg.sequence_parallel: .*TransformerEngine is not installed"):
        Policy(make_cluster(1, use_gpus=True), config, tiny_tokenizer, name_prefix="megatron-gpu-sp")
