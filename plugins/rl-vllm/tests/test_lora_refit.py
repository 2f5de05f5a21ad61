"""LoRA refit into real vLLM engines: merged weights, the whole model once, then only the adapted layers.

A dtensor and an fsdp1 policy (dp=2) train LoRA adapters on q_proj, v_proj and
the LM head, so a partial refit must widen them to the whole fused q/k/v group
(vLLM's ``qkv_proj``); the engines share the policy's bundles. An adapter
refit hands a second pair of engines (LoRA enabled) the adapters alone. After
every refit the engines' greedy logprobs must equal the policy's.
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

WORLD = 2
MAX_NEW = 6
ATOL = 1e-4


@pytest.fixture(scope="module", params=["dtensor", "fsdp1"])
def setup(
    request: pytest.FixtureRequest, ray_session: None, tiny_model_dir: str, tiny_tokenizer: Any
) -> Iterator[dict]:
    from rl_vllm.generation import VllmGeneration
    from rlcore.policy import Policy

    cfg = load_config_dict(
        {
            "cluster": {"workers_per_node": WORLD},
            "policy": {
                "backend": request.param,
                "model_name": tiny_model_dir,
                "precision": "float32",
                "train_global_batch_size": 4,
                "train_micro_batch_size": 1,
                "max_total_sequence_length": 64,
                "optimizer": {"name": "torch.optim.SGD", "kwargs": {"lr": 2.0}},
                "max_grad_norm": None,
                "lora": {
                    "enabled": True,
                    "match_all_linear": False,
                    "target_modules": ["q_proj", "v_proj", "lm_head"],
                    "dim": 4,
                    "alpha": 8,
                    "lora_A_init": "uniform",
                },
                "generation": {
                    "backend": "vllm",
                    "max_new_tokens": MAX_NEW,
                    "pad_token_id": tiny_tokenizer.pad_token_id,
                    "vllm_cfg": {"kv_cache_space_gb": 0.0625, "max_model_len": 128},
                },
            },
        }
    ).policy
    clusters = ClusterPool()
    cluster = clusters(WORLD, max_colocated_worker_groups=3)
    policy = generation = adapter_engines = None
    try:
        policy = Policy(
            cluster, cfg, tiny_tokenizer, name_prefix=f"lora-refit-{request.param}", init_reference_model=False
        )
        generation = VllmGeneration(cluster, cfg.generation, name_prefix=f"lora-refit-{request.param}-vllm")
        adapter_engines = VllmGeneration(
            cluster, cfg.generation, name_prefix=f"lora-refit-{request.param}-lora", lora_rank=cfg.lora.dim
        )
        yield {
            "policy": policy,
            "generation": generation,
            "adapter_engines": adapter_engines,
            "cluster": cluster,
            "tokenizer": tiny_tokenizer,
        }
    finally:
        for owner in (adapter_engines, generation, policy):
            if owner is not None:
                owner.shutdown()
        clusters.shutdown()


def train_one_step(setup: dict, seed: int) -> None:
    from rlcore.algorithms.loss_functions import NLLLoss

    setup["policy"].train(BatchedDataDict(make_batch(setup["tokenizer"], 4, 5, 16, seed=seed)), NLLLoss())


def logprob_error(setup: dict, engines: str = "generation") -> float:
    """Max |engine - policy| logprob over the engines' greedy tokens."""
    raw = make_batch(setup["tokenizer"], 4, 3, 8, seed=3)
    data = BatchedDataDict(input_ids=raw["input_ids"], input_lengths=raw["input_lengths"])
    out = setup[engines].generate(data, greedy=True)
    seqs = BatchedDataDict(input_ids=out["output_ids"], input_lengths=out["unpadded_sequence_lengths"])
    expected = setup["policy"].get_logprobs(seqs)["logprobs"]
    positions = torch.arange(out["output_ids"].shape[1])[None, :]
    mask = (positions >= data["input_lengths"][:, None]) & (positions < out["unpadded_sequence_lengths"][:, None])
    return float((out["logprobs"] - expected)[mask].abs().max())


def test_merged_refits_send_the_model_once_then_only_the_adapted_layers(setup: dict) -> None:
    policy = setup["policy"]
    full_info, changed_info = policy.prepare_refit_info(), policy.prepare_refit_info(changed_only=True)
    assert not [n for n in full_info if "lora_" in n or "base_layer" in n], "refit names must be Hugging Face's"
    assert {n.rsplit(".", 2)[-2] for n in changed_info} == {"q_proj", "k_proj", "v_proj", "lm_head"}, sorted(
        changed_info
    )

    sync = WeightSynchronizer(policy, setup["generation"], colocated=True, partial_refit=True)
    first = sync.sync_weights()
    assert logprob_error(setup) <= ATOL
    sizes = {"full": first["bytes"]}
    for transport, seed in (("shared memory", 11), ("collective", 12)):
        train_one_step(setup, seed)
        moved = logprob_error(setup)
        assert moved > 1e-3, "the LoRA step did not change the policy: the refit check would be vacuous"
        if transport == "collective":
            sync = WeightSynchronizer(
                policy, setup["generation"], colocated=False, cluster=setup["cluster"], partial_refit=True
            )
            sync.sync_weights()  # a new synchronizer's first refit is whole again
            train_one_step(setup, seed + 100)
        stats = sync.sync_weights()
        sizes[transport] = stats["bytes"]
        err = logprob_error(setup)
        assert err <= ATOL, f"{transport} partial refit: engine logprobs differ from the policy's by {err:.3g}"
    expected_ratio = sum(torch.Size(s).numel() for s, _ in changed_info.values()) / sum(
        torch.Size(s).numel() for s, _ in full_info.values()
    )
    for transport in ("shared memory", "collective"):
        ratio = sizes[transport] / sizes["full"]
        assert ratio == pytest.approx(expected_ratio, rel=0.05), (transport, ratio, expected_ratio)


def test_adapter_refit_runs_the_policy_adapters_as_vllm_lora_modules(setup: dict) -> None:
    """``policy.lora.refit: adapter``: only A and B leave the policy (a PEFT directory), the engines run them
    as vLLM LoRA modules over the base weights they loaded, and their logprobs are the policy's."""
    policy = setup["policy"]
    whole = sum(torch.Size(s).numel() for s, _ in policy.prepare_refit_info().values()) * 4
    sync = WeightSynchronizer(policy, setup["adapter_engines"], colocated=True, adapter_refit=True)
    try:
        for seed in (21, 22):
            train_one_step(setup, seed)
            stats = sync.sync_weights()
            err = logprob_error(setup, "adapter_engines")
            assert err <= ATOL, f"adapter refit: engine logprobs differ from the policy's by {err:.3g}"
            assert stats["bytes"] < 0.05 * whole, (stats["bytes"], whole)
        root = sync._adapter_root
        assert [p.name for p in root.iterdir()] == ["v2"], "an older adapter directory was left behind"
    finally:
        sync.shutdown()
    assert not root.exists()
