"""An engine that spans ranks: ``vllm_cfg.tensor_parallel_size: 2`` trains and refits, colocated and collective.

One placement for the module: a 2-bundle cluster holding two ``reference`` training ranks and one vLLM engine
of tensor_parallel_size 2, whose rank ``r`` is an engine actor in bundle ``r`` beside training rank ``r``.
Colocated, training rank ``r`` streams the whole model to engine rank ``r`` in the first refit; each engine
rank records which slices its loaders read (its shards), and the refits after it carry only those. By
collective, training rank 0 broadcasts the whole model to both engine ranks. The reference is the policy's own
``get_logprobs`` (a float32 forward of the same weights, equal to a tensor_parallel_size 1 engine's logprobs
to 1e-4, ``test_refit.py``), and the greedy tokens must be the policy's argmax.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from rlcore.config import load_config_dict
from rlcore.data import BatchedDataDict
from rlcore.refit import WeightSynchronizer
from rlcore.testing.models import make_batch
from rlcore.testing.pytest_plugin import ClusterPool

#: Two engines (TP 2 ranks + training ranks) start per module: ~90 s on the idle 2-core machine.
pytestmark = pytest.mark.slow

WORLD = 2
MAX_NEW = 6
#: float32 engine sharded over two ranks (all-reduced partial sums) against the policy's float32 forward.
ATOL = 1e-4
BUCKET = 64 << 10  # several buckets for the tiny model


@pytest.fixture(scope="module")
def setup(ray_session: None, tiny_model_dir: str, tiny_tokenizer: Any) -> Iterator[dict[str, Any]]:
    from rl_vllm.generation import VllmGeneration
    from rlcore.policy import Policy

    cfg = load_config_dict(
        {
            "cluster": {"workers_per_node": WORLD},
            "policy": {
                "backend": "reference",
                "model_name": tiny_model_dir,
                "precision": "float32",
                "train_global_batch_size": 4,
                "train_micro_batch_size": 1,
                "max_total_sequence_length": 64,
                "optimizer": {"name": "torch.optim.SGD", "kwargs": {"lr": 0.5}},
                "max_grad_norm": None,
                "generation": {
                    "backend": "vllm",
                    "max_new_tokens": MAX_NEW,
                    "pad_token_id": tiny_tokenizer.pad_token_id,
                    "vllm_cfg": {"kv_cache_space_gb": 0.0625, "max_model_len": 128, "tensor_parallel_size": 2},
                },
            },
        }
    ).policy
    clusters = ClusterPool()
    policy = generation = None
    try:
        cluster = clusters(WORLD, max_colocated_worker_groups=2)
        policy = Policy(cluster, cfg, tiny_tokenizer, name_prefix="tp-refit", init_reference_model=False)
        generation = VllmGeneration(cluster, cfg.generation, name_prefix="tp-refit-vllm")
        yield {"policy": policy, "generation": generation, "cluster": cluster, "tokenizer": tiny_tokenizer}
    finally:
        for owner in (generation, policy):
            if owner is not None:
                owner.shutdown()
        clusters.shutdown()


def train_one_step(setup: dict[str, Any], seed: int) -> None:
    from rlcore.algorithms.loss_functions import NLLLoss

    setup["policy"].train(BatchedDataDict(make_batch(setup["tokenizer"], 4, 5, 16, seed=seed)), NLLLoss())


def engine_error(setup: dict[str, Any]) -> float:
    """Max |engine - policy| logprob over the tokens the engine generates greedily."""
    raw = make_batch(setup["tokenizer"], 4, 3, 8, seed=3)
    prompts = BatchedDataDict(input_ids=raw["input_ids"], input_lengths=raw["input_lengths"])
    out = setup["generation"].generate(prompts, greedy=True)
    seqs = BatchedDataDict(input_ids=out["output_ids"], input_lengths=out["unpadded_sequence_lengths"])
    expected = setup["policy"].get_logprobs(seqs)["logprobs"]
    positions = torch.arange(out["output_ids"].shape[1])[None, :]
    generated = (positions >= prompts["input_lengths"][:, None]) & (
        positions < out["unpadded_sequence_lengths"][:, None]
    )
    assert bool(generated.any()), "nothing was generated: the comparison would be vacuous"
    return float((out["logprobs"] - expected)[generated].abs().max())


def refit_and_compare(setup: dict[str, Any], sync: WeightSynchronizer, seed: int) -> dict[str, float]:
    train_one_step(setup, seed)
    stale = engine_error(setup)
    assert stale > 1e-3, "the training step did not change the policy: the refit test would be vacuous"
    stats = sync.sync_weights()
    err = engine_error(setup)
    assert err <= ATOL, f"the tensor-parallel engine's logprobs differ from the policy's by {err:.3g}"
    return stats


def test_one_engine_over_two_bundles(setup: dict[str, Any]) -> None:
    generation = setup["generation"]
    assert generation.num_engines == 1 and generation.refit_world_size() == 2
    info = generation.engine_info
    assert len({i["pid"] for i in info}) == 2, "each rank of the engine is its own process"


def test_colocated_refit_feeds_each_engine_rank(setup: dict[str, Any]) -> None:
    """Train a step; a verified shared-memory refit (training rank r to engine rank r) makes the engine's
    logprobs the policy's."""
    sync = WeightSynchronizer(
        setup["policy"], setup["generation"], colocated=True, bucket_bytes=BUCKET, verify=True, weight_version=4
    )
    stats = refit_and_compare(setup, sync, seed=11)  # verified: each engine rank holds what its training rank sent
    assert sync.transport == "shared_memory" and stats["weight_version"] == 4
    assert stats["verified_tensors"] == len(setup["policy"].prepare_refit_info())
    # Each engine rank recorded the slices its loaders read; now its training rank writes (and both sides
    # fingerprint) only those: about half the bytes at tensor_parallel_size 2, and the same logprobs.
    second = refit_and_compare(setup, sync, seed=13)
    assert second["verified_tensors"] == stats["verified_tensors"] and second["weight_version"] == 5
    assert second["bytes"] < 0.7 * stats["bytes"], (second["bytes"], stats["bytes"])


def test_collective_refit_feeds_each_engine_rank(setup: dict[str, Any]) -> None:
    """The same through the broadcast: training rank 0 and both engine ranks in one gloo group."""
    sync = WeightSynchronizer(
        setup["policy"],
        setup["generation"],
        colocated=False,
        cluster=setup["cluster"],
        bucket_bytes=BUCKET,
        verify=True,
    )
    stats = refit_and_compare(setup, sync, seed=12)
    assert sync.transport == "collective" and stats["verified_tensors"] == len(setup["policy"].prepare_refit_info())
