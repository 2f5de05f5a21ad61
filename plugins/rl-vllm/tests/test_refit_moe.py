"""Refit of a mixture-of-experts model into a real vLLM engine: per-expert HF names into fused expert weights.

The engine serves the built-in ``tiny-qwen3-moe`` (8 experts, top-2, two layers). The weights are sent from
this process as a plain Hugging Face state dict with the per-expert names of the checkpoint
(``model.layers.0.mlp.experts.3.up_proj.weight``); vLLM's loader stacks them into its fused
``w13_weight`` / ``w2_weight`` parameters. The reference is independent of vLLM: Hugging Face's own model,
loaded in float64 from a checkpoint of the same perturbed weights. One engine for the module; each test
perturbs the weights differently, so a refit that did not land (or landed partly) fails the comparison.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import ray
import torch

from rlcore.config import load_config_dict
from rlcore.data import BatchedDataDict
from rlcore.refit import RefitError
from rlcore.refit.fingerprint import verify_engines
from rlcore.testing.pytest_plugin import ClusterPool

MAX_NEW = 6
#: float32 engine against a float64 Hugging Face forward (measured: about 5e-7).
ATOL = 1e-4
BUCKET = 64 << 10  # several buckets for the tiny MoE, some layers split over two
PROMPTS = [[1, 50, 60, 70, 80], [1, 90, 91], [1, 33, 34, 35, 36, 37, 38]]


def checkpoint_weights(model_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(".safetensors"):
            weights.update(load_file(os.path.join(model_dir, name)))
    return weights


def perturbed(weights: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=generator, dtype=v.dtype) for k, v in weights.items()}


def hf_float64_logprobs(
    model_dir: str, weights: dict[str, torch.Tensor], sequences: list[list[int]]
) -> list[torch.Tensor]:
    """Next-token log-probabilities ``[len - 1, vocab]`` of each sequence under Hugging Face's Qwen3-MoE holding
    ``weights``, in float64 (its per-expert loop: the grouped-GEMM experts run in float32 only)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    scratch = tempfile.mkdtemp(prefix="rlcore-moe-ref-")
    try:
        for name in os.listdir(model_dir):
            if not name.endswith(".safetensors"):
                shutil.copy(os.path.join(model_dir, name), scratch)
        save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(scratch, "model.safetensors"))
        model = AutoModelForCausalLM.from_pretrained(scratch, dtype=torch.float64, experts_implementation="eager")
    finally:
        shutil.rmtree(scratch)
    out = []
    with torch.no_grad():
        for seq in sequences:
            logits = model(torch.tensor([seq])).logits[0]
            out.append(torch.log_softmax(logits, -1)[:-1])
    return out


@pytest.fixture(scope="module")
def engine(ray_session: None) -> Iterator[dict[str, Any]]:
    from rl_vllm.generation import VllmGeneration
    from rlcore.models import resolve_model

    model_dir = resolve_model("tiny-qwen3-moe")
    cfg = load_config_dict(
        {
            "cluster": {"workers_per_node": 1},
            "policy": {
                "model_name": model_dir,
                "generation": {
                    "backend": "vllm",
                    "max_new_tokens": MAX_NEW,
                    "pad_token_id": 0,
                    "vllm_cfg": {"kv_cache_space_gb": 0.0625, "max_model_len": 128},
                },
            },
        }
    ).policy
    clusters = ClusterPool()
    generation = None
    try:
        cluster = clusters(1)
        generation = VllmGeneration(cluster, cfg.generation, name_prefix="moe-refit-vllm")
        weights = checkpoint_weights(model_dir)
        info = {k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in weights.items()}
        generation.prepare_refit_info(info)
        yield {"generation": generation, "cluster": cluster, "model_dir": model_dir, "weights": weights, "info": info}
    finally:
        if generation is not None:
            generation.shutdown()
        clusters.shutdown()


def assert_engine_matches_hf(engine: dict[str, Any], weights: dict[str, torch.Tensor]) -> None:
    lengths = torch.tensor([len(p) for p in PROMPTS])
    ids = torch.zeros(len(PROMPTS), int(lengths.max()), dtype=torch.long)
    for i, p in enumerate(PROMPTS):
        ids[i, : len(p)] = torch.tensor(p)
    out = engine["generation"].generate(BatchedDataDict(input_ids=ids, input_lengths=lengths), greedy=True)
    sequences = [out["output_ids"][i, :n].tolist() for i, n in enumerate(out["unpadded_sequence_lengths"].tolist())]
    reference = hf_float64_logprobs(engine["model_dir"], weights, sequences)
    for i, (seq, ref) in enumerate(zip(sequences, reference)):
        start = len(PROMPTS[i])
        generated = torch.tensor(seq[start:])
        rows = ref[start - 1 :]
        want = rows.gather(1, generated[:, None])[:, 0]
        err = float((out["logprobs"][i, start : len(seq)].double() - want).abs().max())
        assert err <= ATOL, f"prompt {i}: engine logprobs differ from HF float64 of the refit weights by {err:.3g}"
        top2 = rows.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 1e-3  # greedy picks HF's argmax wherever it is not a near-tie
        assert torch.equal(generated[clear], rows.argmax(-1)[clear]), f"prompt {i}: greedy tokens differ from HF's"


def stream_shared_memory(engine: dict[str, Any], weights: dict[str, torch.Tensor], version: int) -> dict[str, int]:
    from rlcore.refit.shared_memory import stream_to_receiver

    generation, info = engine["generation"], engine["info"]
    address, key = generation.refit_endpoints()[0]
    receivers = generation.update_weights_via_ipc_zmq(bucket_bytes=BUCKET)
    sent = stream_to_receiver(((k, weights[k]) for k in info), info, address, key, BUCKET, torch.device("cpu"))
    ray.get(receivers, timeout=300)
    generation.set_weight_version(version)
    return sent.fingerprints


def test_shared_memory_refit_lands_in_the_fused_experts_and_is_verified(engine: dict[str, Any]) -> None:
    """Perturbed per-expert weights by shared memory: the engine's logprobs are HF's of those weights, and the
    engine's fingerprints (taken on the per-expert tensors as received) equal the sender's, experts included."""
    weights = perturbed(engine["weights"], seed=1)
    sent = stream_shared_memory(engine, weights, version=3)
    experts = [n for n in sent if ".mlp.experts." in n]
    assert len(experts) == 2 * 8 * 3, "the fingerprints must cover every expert tensor (2 layers x 8 x 3)"
    assert verify_engines(sent, engine["generation"].weight_fingerprints(), version=3) == 3
    assert_engine_matches_hf(engine, weights)

    # One element of one expert's up projection changed on the way: the check names that tensor.
    name = "model.layers.1.mlp.experts.5.up_proj.weight"
    corrupted = {**weights, name: weights[name].clone()}
    corrupted[name].view(-1)[-1] += 1.0
    stream_shared_memory(engine, corrupted, version=4)
    with pytest.raises(RefitError, match=f"engine 0 holds fingerprint .* tensor '{name}'"):
        verify_engines(sent, engine["generation"].weight_fingerprints(), version=4)


def test_collective_refit_lands_in_the_fused_experts(engine: dict[str, Any]) -> None:
    """The same through the broadcast transport: this process is group rank 0, the engine rank 1."""
    from rlcore.refit.collective import broadcast_weights, init_refit_group

    generation, info = engine["generation"], engine["info"]
    ip, port = engine["cluster"].get_master_address_and_port()
    joined = generation.init_collective(ip, port, 2, train_world_size=1)
    groups: list[Any] = []
    joiner = threading.Thread(target=lambda: groups.append(init_refit_group(ip, port, 2, 0, torch.device("cpu"))))
    joiner.start()
    ray.get(joined, timeout=300)
    joiner.join(timeout=300)
    assert groups, "the driver did not join the refit group"
    weights = perturbed(engine["weights"], seed=2)
    receivers = generation.update_weights_from_collective(bucket_bytes=BUCKET)
    sent = broadcast_weights(groups[0], ((k, weights[k]) for k in info), info, BUCKET, torch.device("cpu"))
    ray.get(receivers, timeout=300)
    generation.set_weight_version(7)
    assert verify_engines(sent.fingerprints, generation.weight_fingerprints(), version=7) == 7
    assert_engine_matches_hf(engine, weights)


@pytest.mark.slow
def test_a_tensor_parallel_engine_refits_the_moe(ray_session: None) -> None:
    """tensor_parallel_size 2: each engine rank receives the whole per-expert state dict by shared memory and
    keeps its shard of the fused experts; the engine's logprobs are HF's float64 ones of the refit weights."""
    from rl_vllm.generation import VllmGeneration
    from rlcore.models import resolve_model
    from rlcore.refit.shared_memory import stream_to_receiver

    model_dir = resolve_model("tiny-qwen3-moe")
    vllm_cfg = {"kv_cache_space_gb": 0.0625, "max_model_len": 128, "tensor_parallel_size": 2}
    gen = {"backend": "vllm", "max_new_tokens": MAX_NEW, "pad_token_id": 0, "vllm_cfg": vllm_cfg}
    cfg = load_config_dict({"cluster": {"workers_per_node": 2}, "policy": {"model_name": model_dir, "generation": gen}})
    clusters = ClusterPool()
    generation = None
    try:
        generation = VllmGeneration(clusters(2), cfg.policy.generation, name_prefix="moe-tp-vllm")
        weights = perturbed(checkpoint_weights(model_dir), seed=3)
        info = {k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in weights.items()}
        generation.prepare_refit_info(info)
        endpoints = generation.refit_endpoints()
        receivers = generation.update_weights_via_ipc_zmq(bucket_bytes=BUCKET)
        # One sender after the other: this process's sender buffers are pooled, one set per process (a training
        # rank is a process of its own), and an engine rank's load needs nothing from the other rank.
        cpu = torch.device("cpu")
        sent = {
            rank: stream_to_receiver(((k, weights[k]) for k in info), info, *endpoints[rank], BUCKET, cpu)
            for rank in sorted(endpoints)
        }
        ray.get(receivers, timeout=300)
        generation.set_weight_version(2)
        reports = generation.weight_fingerprints()
        assert len(reports) == 2, "one report per engine rank"
        assert verify_engines([sent[0].fingerprints, sent[1].fingerprints], reports, version=2) == 2
        assert_engine_matches_hf({"generation": generation, "model_dir": model_dir}, weights)
    finally:
        if generation is not None:
            generation.shutdown()
        clusters.shutdown()


@pytest.mark.slow
def test_a_dtensor_trained_moe_refits_into_the_engine(ray_session: None, tiny_tokenizer: Any) -> None:
    """The whole path: dtensor trains tiny-qwen3-moe a step, a verified colocated refit carries its per-expert
    tensors into the engine's fused experts, and the engine's logprobs equal the policy's."""
    from rl_vllm.generation import VllmGeneration
    from rlcore.algorithms.loss_functions import NLLLoss
    from rlcore.models import resolve_model
    from rlcore.policy import Policy
    from rlcore.refit import WeightSynchronizer
    from rlcore.testing.models import make_batch

    model_dir = resolve_model("tiny-qwen3-moe")
    gen = {"backend": "vllm", "max_new_tokens": MAX_NEW, "pad_token_id": tiny_tokenizer.pad_token_id}
    gen["vllm_cfg"] = {"kv_cache_space_gb": 0.0625, "max_model_len": 128}
    policy_cfg = {"backend": "dtensor", "model_name": model_dir, "precision": "float32", "generation": gen}
    policy_cfg.update(train_global_batch_size=2, train_micro_batch_size=1, max_total_sequence_length=64)
    policy_cfg.update(optimizer={"name": "torch.optim.SGD", "kwargs": {"lr": 0.5}}, max_grad_norm=None)
    cfg = load_config_dict({"cluster": {"workers_per_node": 1}, "policy": policy_cfg}).policy
    clusters = ClusterPool()
    policy = generation = None
    try:
        cluster = clusters(1, max_colocated_worker_groups=2)
        policy = Policy(cluster, cfg, tiny_tokenizer, name_prefix="moe-dtensor", init_reference_model=False)
        generation = VllmGeneration(cluster, cfg.generation, name_prefix="moe-dtensor-vllm")
        raw = make_batch(tiny_tokenizer, 4, 3, 8, seed=3)
        prompts = BatchedDataDict(input_ids=raw["input_ids"], input_lengths=raw["input_lengths"])
        policy.train(BatchedDataDict(make_batch(tiny_tokenizer, 2, 5, 16, seed=1)), NLLLoss())
        stale = engine_vs_policy(generation, policy, prompts)
        assert stale > 1e-3, "the training step did not change the policy: the refit test would be vacuous"
        stats = WeightSynchronizer(policy, generation, colocated=True, bucket_bytes=BUCKET, verify=True).sync_weights()
        assert stats["verified_tensors"] == len(policy.prepare_refit_info())
        assert any(".mlp.experts.0." in name for name in policy.prepare_refit_info()), "per-expert names"
        err = engine_vs_policy(generation, policy, prompts)
    finally:
        for owner in (generation, policy):
            if owner is not None:
                owner.shutdown()
        clusters.shutdown()
    assert err <= ATOL, f"after the refit the engine's logprobs differ from the dtensor policy's by {err:.3g}"


def engine_vs_policy(generation: Any, policy: Any, prompts: BatchedDataDict) -> float:
    """Max |engine - policy| logprob over the tokens the engine generates greedily for ``prompts``."""
    out = generation.generate(prompts, greedy=True)
    seqs = BatchedDataDict(input_ids=out["output_ids"], input_lengths=out["unpadded_sequence_lengths"])
    expected = policy.get_logprobs(seqs)["logprobs"]
    positions = torch.arange(out["output_ids"].shape[1])[None, :]
    generated = (positions >= prompts["input_lengths"][:, None]) & (
        positions < out["unpadded_sequence_lengths"][:, None]
    )
    return float((out["logprobs"] - expected)[generated].abs().max())
