"""Refit from the megatron backend (TP=2) into real vLLM engines, on CPU, through both transports.

A 2-bundle colocated cluster holds the two megatron ranks and two vLLM
engines (engine r shares bundle r with training rank r). After a training
step and a refit, the engines' logprobs of greedy generations equal the
policy's ``get_logprobs`` of the same sequences (design.md §2.7). Skipped when
rl-vllm is not installed.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from megatron_helpers import batch, model_dir, policy_config

pytest_plugins = ["rlcore.testing.pytest_plugin"]
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

ATOL = 1e-4  # vLLM's CPU kernels vs the policy (the rl-vllm suite's tolerance)
MAX_NEW = 6


@pytest.fixture(scope="module")
def setup(ray_session: None, tiny_tokenizer: Any) -> Iterator[dict]:
    pytest.importorskip("rl_vllm", reason="rl-vllm is not installed")
    from rl_vllm.generation import VllmGeneration
    from rlcore.policy import Policy
    from rlcore.testing.pytest_plugin import ClusterPool

    path = model_dir("llama")
    config = policy_config(
        path,
        2,
        megatron={"tensor_model_parallel_size": 2},
        max_total_sequence_length=64,
        generation={
            "backend": "vllm",
            "max_new_tokens": MAX_NEW,
            "pad_token_id": tiny_tokenizer.pad_token_id,
            "vllm_cfg": {"kv_cache_space_gb": 0.0625, "max_model_len": 128},
        },
    )
    clusters = ClusterPool()
    cluster = clusters(2, max_colocated_worker_groups=2)
    policy = generation = None
    try:
        policy = Policy(cluster, config, tiny_tokenizer, name_prefix="refit-megatron", init_reference_model=False)
        generation = VllmGeneration(cluster, config.generation, name_prefix="refit-megatron-vllm")
        yield {"policy": policy, "generation": generation, "cluster": cluster, "tokenizer": tiny_tokenizer}
    finally:
        for owner in (generation, policy):
            if owner is not None:
                owner.shutdown()
        clusters.shutdown()


def _train_step(setup: dict, seed: int) -> None:
    from rlcore.algorithms.loss_functions import NLLLoss

    setup["policy"].train(batch(setup["tokenizer"], seed=seed), NLLLoss())


def _engine_vs_policy_error(setup: dict) -> float:
    from rlcore.data import BatchedDataDict

    prompts = batch(setup["tokenizer"], seed=11)
    prompts = BatchedDataDict(
        input_ids=prompts["input_ids"][:, :8].clone(), input_lengths=prompts["input_lengths"].clamp(max=8)
    )
    out = setup["generation"].generate(prompts, greedy=True)
    seqs = BatchedDataDict(input_ids=out["output_ids"], input_lengths=out["unpadded_sequence_lengths"])
    expected = setup["policy"].get_logprobs(seqs)["logprobs"]
    positions = torch.arange(out["output_ids"].shape[1])[None, :]
    generated = (positions >= prompts["input_lengths"][:, None]) & (
        positions < out["unpadded_sequence_lengths"][:, None]
    )
    return float((out["logprobs"] - expected)[generated].abs().max())


def test_refit_by_shared_memory(setup: dict) -> None:
    from rlcore.refit import WeightSynchronizer

    _train_step(setup, seed=100)
    assert _engine_vs_policy_error(setup) > 1e-3, "training did not move the policy: the test would be vacuous"
    sync = WeightSynchronizer(setup["policy"], setup["generation"], colocated=True, bucket_bytes=32 << 10)
    assert sync.sync_weights()["bytes"] > 0 and sync.transport == "shared_memory"
    assert _engine_vs_policy_error(setup) <= ATOL


def test_refit_by_collective(setup: dict) -> None:
    from rlcore.refit import WeightSynchronizer

    _train_step(setup, seed=200)
    sync = WeightSynchronizer(
        setup["policy"], setup["generation"], colocated=False, cluster=setup["cluster"], bucket_bytes=32 << 10
    )
    sync.sync_weights()
    assert sync.transport == "collective"
    assert _engine_vs_policy_error(setup) <= ATOL
