"""Refit into an engine whose LM head is tied to the input embeddings (Qwen2.5-0.5B's layout).

dtensor sends the embedding only (the tied duplicate is dropped, as
``save_pretrained`` does); on CPU vLLM packs the head's own copy of the weight
for the logits GEMM, so the engine must redo that after the reload or its
logprobs keep the old head.
"""

from __future__ import annotations

import torch

from rlcore.algorithms.loss_functions import NLLLoss
from rlcore.config import load_config_dict
from rlcore.data import BatchedDataDict
from rlcore.models import tiny_model_path
from rlcore.refit import WeightSynchronizer
from rlcore.testing.models import make_batch
from rlcore.testing.pytest_plugin import ClusterPool

ATOL = 1e-4


def test_a_tied_lm_head_follows_the_embedding_through_a_refit(ray_session, tiny_tokenizer):
    from rl_vllm.generation import VllmGeneration
    from rlcore.policy import Policy

    # Wide enough that vLLM's CPU GEMM repacks the head (oneDNN); the tiny default shapes are not.
    model_dir = tiny_model_path(
        arch="qwen2",
        tie_word_embeddings=True,
        hidden_size=256,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        intermediate_size=512,
        vocab_size=4096,
    )
    cfg = load_config_dict(
        {
            "cluster": {"workers_per_node": 1},
            "policy": {
                "backend": "dtensor",
                "model_name": model_dir,
                "precision": "float32",
                "train_global_batch_size": 4,
                "train_micro_batch_size": 2,
                "max_total_sequence_length": 64,
                "optimizer": {"name": "torch.optim.SGD", "kwargs": {"lr": 0.5}},
                "max_grad_norm": None,
                "generation": {
                    "backend": "vllm",
                    "max_new_tokens": 6,
                    "pad_token_id": tiny_tokenizer.pad_token_id,
                    "vllm_cfg": {"kv_cache_space_gb": 0.0625, "max_model_len": 128},
                },
            },
        }
    ).policy
    clusters = ClusterPool()
    policy = generation = None
    try:
        cluster = clusters(1, max_colocated_worker_groups=2)
        policy = Policy(cluster, cfg, tiny_tokenizer, name_prefix="tied-refit", init_reference_model=False)
        generation = VllmGeneration(cluster, cfg.generation, name_prefix="tied-refit-vllm")
        sync = WeightSynchronizer(policy, generation, colocated=True)
        policy.train(BatchedDataDict(make_batch(tiny_tokenizer, 4, 5, 16, seed=1)), NLLLoss())
        sync.sync_weights()
        raw = make_batch(tiny_tokenizer, 4, 3, 8, seed=3)
        prompts = BatchedDataDict(input_ids=raw["input_ids"], input_lengths=raw["input_lengths"])
        out = generation.generate(prompts, greedy=True)
        seqs = BatchedDataDict(input_ids=out["output_ids"], input_lengths=out["unpadded_sequence_lengths"])
        expected = policy.get_logprobs(seqs)["logprobs"]
    finally:
        for owner in (generation, policy):
            if owner is not None:
                owner.shutdown()
        clusters.shutdown()
    positions = torch.arange(out["output_ids"].shape[1])[None, :]
    generated = (positions >= prompts["input_lengths"][:, None]) & (
        positions < out["unpadded_sequence_lengths"][:, None]
    )
    err = float((out["logprobs"] - expected)[generated].abs().max())
    assert err <= ATOL, f"after the refit the tied engine's logprobs differ from the policy's by {err:.3g}"
