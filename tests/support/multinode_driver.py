"""Driver programs for the multi-node tests: each attaches to Ray through ``RAY_ADDRESS`` and prints JSON.

Run as ``python tests/support/multinode_driver.py <scenario> [args]`` with a local multi-node cluster's
driver environment (``rlcore.testing.local_cluster``); the same functions run in the test process
against the single-node session Ray, for the reference results. The result is the stdout line
starting with ``RESULT``, as JSON.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

LR = 0.5
SGD = {"name": "torch.optim.SGD", "kwargs": {"lr": LR}}
MEGATRON_SGD = {
    "optimizer": {"optimizer": "sgd", "sgd_momentum": 0.0, "weight_decay": 0.0},
    "scheduler": {"start_weight_decay": 0.0, "end_weight_decay": 0.0},
}


def policy_config(backend: str, model_dir: str, world: int, **extra: Any) -> Any:
    from rlcore.config import load_config_dict

    raw = {
        "backend": backend,
        "model_name": model_dir,
        "train_global_batch_size": 4,
        "train_micro_batch_size": 1,
        "logprob_batch_size": 2,
        "max_grad_norm": None,
        "precision": "float32",
        "max_total_sequence_length": 32,
        **({"learning_rate": LR, "megatron_cfg": MEGATRON_SGD} if backend == "megatron" else {"optimizer": SGD}),
        **extra,
    }
    return load_config_dict({"cluster": {"workers_per_node": world}, "policy": raw}).policy


def placement(strategy: str, bundles: int) -> dict[str, Any]:
    """Which node (by id) and local rank each bundle of a ``bundles``-rank cluster landed on."""
    from rlcore.distributed import RayVirtualCluster

    cluster = RayVirtualCluster([int(bundles)], placement_group_strategy=strategy, placement_timeout_s=30)
    try:
        return {"bundles": [[b.node_id, b.local_rank] for b in cluster.bundles()]}
    finally:
        cluster.shutdown()


def train(backend: str, model_dir: str, strategy: str) -> dict[str, Any]:
    """One SGD step of a 2-rank policy placed with ``strategy``; its loss and the logprobs after it."""
    from rlcore.algorithms.loss_functions import NLLLoss
    from rlcore.data import BatchedDataDict
    from rlcore.distributed import RayVirtualCluster
    from rlcore.policy import Policy
    from rlcore.testing.models import build_tiny_tokenizer, make_batch

    tokenizer = build_tiny_tokenizer()
    cluster = RayVirtualCluster([2], placement_group_strategy=strategy, placement_timeout_s=60)
    policy = Policy(cluster, policy_config(backend, model_dir, 2), tokenizer, init_reference_model=False)
    try:
        data = BatchedDataDict(make_batch(tokenizer, 4, 5, 16, seed=7))
        result = policy.train(data, NLLLoss())
        logprobs = policy.get_logprobs(data)["logprobs"]
        nodes = sorted({b.node_id for b in cluster.bundles()})
        return {"loss": result["loss"].tolist(), "logprobs": logprobs.tolist(), "nodes": len(nodes)}
    finally:
        policy.shutdown()
        cluster.shutdown()


def refit(model_dir: str, transport: str) -> dict[str, Any]:
    """Train a step, refit vLLM engines, and compare their greedy logprobs with the policy's.

    ``shared_memory``: training ranks SPREAD over the nodes, one engine colocated with each.
    ``collective``: training PACKed onto one node, the engine's own cluster on the other.
    """
    import torch

    from rl_vllm.generation import VllmGeneration
    from rlcore.algorithms.loss_functions import NLLLoss
    from rlcore.config import load_config_dict
    from rlcore.data import BatchedDataDict
    from rlcore.distributed import RayVirtualCluster
    from rlcore.policy import Policy
    from rlcore.refit import WeightSynchronizer
    from rlcore.testing.models import build_tiny_tokenizer, make_batch

    tokenizer = build_tiny_tokenizer()
    gen_cfg = load_config_dict(
        {
            "policy": {
                "model_name": model_dir,
                "generation": {
                    "backend": "vllm",
                    "max_new_tokens": 6,
                    "pad_token_id": tokenizer.pad_token_id,
                    "vllm_cfg": {"kv_cache_space_gb": 0.0625, "max_model_len": 128},
                },
            }
        }
    ).policy.generation
    colocated = transport == "shared_memory"
    train_cluster = RayVirtualCluster(
        [2],
        placement_group_strategy="SPREAD" if colocated else "PACK",
        max_colocated_worker_groups=2 if colocated else 1,
        placement_timeout_s=60,
    )
    gen_cluster = train_cluster if colocated else RayVirtualCluster([1], name="gen", placement_timeout_s=60)
    owners: list[Any] = []
    try:
        policy = Policy(train_cluster, policy_config("reference", model_dir, 2), tokenizer, init_reference_model=False)
        owners.append(policy)
        generation = VllmGeneration(gen_cluster, gen_cfg)
        owners.append(generation)
        policy.train(BatchedDataDict(make_batch(tokenizer, 4, 5, 16, seed=1)), NLLLoss())
        WeightSynchronizer(policy, generation, colocated=colocated, cluster=train_cluster).sync_weights()
        raw = make_batch(tokenizer, 4, 3, 8, seed=3)
        out = generation.generate(
            BatchedDataDict(input_ids=raw["input_ids"], input_lengths=raw["input_lengths"]), greedy=True
        )
        seqs = BatchedDataDict(input_ids=out["output_ids"], input_lengths=out["unpadded_sequence_lengths"])
        expected = policy.get_logprobs(seqs)["logprobs"]
        positions = torch.arange(out["output_ids"].shape[1])[None, :]
        mask = (positions >= raw["input_lengths"][:, None]) & (positions < out["unpadded_sequence_lengths"][:, None])
        nodes = {b.node_id for c in {train_cluster, gen_cluster} for b in c.bundles()}
        return {"max_error": float((out["logprobs"] - expected)[mask].abs().max()), "nodes": len(nodes)}
    finally:
        for owner in reversed(owners):
            owner.shutdown()
        for cluster in {gen_cluster, train_cluster}:
            cluster.shutdown()


def lose_a_node(model_dir: str) -> dict[str, Any]:
    """Train for a long time on ranks SPREAD over two nodes; the test kills one node meanwhile."""
    from rlcore.algorithms.loss_functions import NLLLoss
    from rlcore.data import BatchedDataDict
    from rlcore.distributed import RayVirtualCluster, WorkerError
    from rlcore.policy import Policy
    from rlcore.testing.models import build_tiny_tokenizer, make_batch

    tokenizer = build_tiny_tokenizer()
    cluster = RayVirtualCluster([2], placement_group_strategy="SPREAD", placement_timeout_s=60)
    cfg = policy_config("reference", model_dir, 2, train_global_batch_size=2)
    policy = Policy(cluster, cfg, tokenizer, init_reference_model=False)
    try:
        print("TRAINING", flush=True)
        started = time.monotonic()
        try:
            policy.train(BatchedDataDict(make_batch(tokenizer, 4000, 4, 14, seed=1)), NLLLoss())
            return {"error": None}
        except WorkerError as exc:
            return {"error": str(exc).splitlines()[0], "seconds": time.monotonic() - started}
    finally:
        policy.shutdown()
        cluster.shutdown()


#: Prefix of the result line (engines and Ray may print to stdout too).
RESULT = "RESULT "
SCENARIOS = {"placement": placement, "train": train, "refit": refit, "lose_a_node": lose_a_node}

if __name__ == "__main__":
    print(RESULT + json.dumps(SCENARIOS[sys.argv[1]](*sys.argv[2:])), flush=True)
