"""rl-vllm without an engine: registration, the vllm_cfg section, and the pure helpers of generate."""

from __future__ import annotations

import os

import pytest
import torch

from rl_vllm.config import VllmConfig, vllm_config_from
from rl_vllm.sampling import Completion, batch_problems, pack_outputs, request_stop_strings, sampled_logprobs
from rlcore.config import ConfigError, GenerationConfig, load_config_dict, resolve
from rlcore.plugins import get_registry


def _config(vllm_cfg: dict):
    return load_config_dict(
        {
            "policy": {
                "backend": "reference",
                "model_name": "tiny",
                "generation": {"backend": "vllm", "vllm_cfg": vllm_cfg},
            }
        }
    )


def test_backend_is_registered_through_its_entry_point():
    record = get_registry(refresh=True).find("vllm")
    assert (record.kind, record.distribution, record.status) == ("generation", "rl-vllm", "ok"), record.problem
    assert {"generate", "refit"} <= record.spec.capabilities


def test_good_section_validates():
    cfg = _config({"kv_cache_space_gb": 0.25, "max_model_len": 128, "precision": "bfloat16"})
    section = resolve(cfg).generation.section  # what rlcore hands VllmGeneration as backend_config
    assert section == vllm_config_from(cfg.policy.generation)
    vcfg = vllm_config_from(cfg.policy.generation)
    assert vcfg.kv_cache_bytes == 256 * 1024**2 and vcfg.precision == "bfloat16"
    assert vllm_config_from(_config({}).policy.generation) == VllmConfig()
    assert vllm_config_from(GenerationConfig()) == VllmConfig()  # no section at all


def test_bad_section_fails_with_dotted_paths():
    cfg = _config({"kv_cache_space_gb": -1, "max_model_lne": 5, "precision": "fp8"})
    with pytest.raises(ConfigError) as caught:
        resolve(cfg)
    problems = caught.value.problems
    assert any(p.startswith("policy.generation.vllm_cfg.kv_cache_space_gb:") and "> 0" in p for p in problems)
    assert any(p.startswith("policy.generation.vllm_cfg.max_model_lne:") and "max_model_len" in p for p in problems)
    assert any(p.startswith("policy.generation.vllm_cfg.precision:") for p in problems)
    with pytest.raises(ConfigError, match=r"policy\.generation\.vllm_cfg\.kv_cache_space_gb"):
        vllm_config_from(cfg.policy.generation)


def test_logits_modes_are_refused_with_the_reason():
    with pytest.raises(ConfigError, match=r"policy\.generation\.vllm_cfg\.logprobs_mode.*log-probabilities"):
        vllm_config_from(_config({"logprobs_mode": "raw_logits"}).policy.generation)
    assert (
        vllm_config_from(_config({"logprobs_mode": "raw_logprobs"}).policy.generation).logprobs_mode == "raw_logprobs"
    )


def test_pipeline_parallel_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"policy\.generation\.vllm_cfg\.pipeline_parallel_size.*tensor_parallel"):
        vllm_config_from(_config({"pipeline_parallel_size": 2}).policy.generation)


def test_tensor_parallel_is_accepted():
    assert vllm_config_from(_config({"tensor_parallel_size": 2}).policy.generation).tensor_parallel_size == 2


def test_request_stop_strings_merge_config_and_sample():
    assert request_stop_strings(["\n"], [["x", "\n"], None, "yz"], 3) == [["\n", "x"], ["\n"], ["\n", "yz"]]
    assert request_stop_strings(None, None, 2) == [[], []]
    with pytest.raises(ValueError, match="2 entries for a batch of 3"):
        request_stop_strings(None, [None, None], 3)


def test_pack_outputs_right_pads_and_aligns_logprobs():
    ids = torch.tensor([[5, 6, 7], [8, 9, 0]])
    lengths = torch.tensor([3, 2])
    done = [Completion([10, 11], [-0.1, -0.2], "stop"), Completion([12, 13, 14], [-0.3, -0.4, -0.5], "length")]
    out = pack_outputs(ids, lengths, done, max_new_tokens=3, pad_token_id=0)
    assert out["output_ids"].tolist() == [[5, 6, 7, 10, 11, 0], [8, 9, 12, 13, 14, 0]]
    assert out["generation_lengths"].tolist() == [2, 3]
    assert out["unpadded_sequence_lengths"].tolist() == [5, 5]
    assert out["truncated"].tolist() == [False, True]
    assert out["logprobs"].dtype == torch.float32
    assert torch.allclose(out["logprobs"], torch.tensor([[0, 0, 0, -0.1, -0.2, 0], [0, 0, -0.3, -0.4, -0.5, 0]]))
    with pytest.raises(ValueError, match="more than max_new_tokens"):
        pack_outputs(ids, lengths, done, max_new_tokens=2, pad_token_id=0)


def test_sampled_logprobs_reads_flat_and_dict_logprobs():
    logprobs = pytest.importorskip("vllm.logprobs")
    flat = logprobs.FlatLogprobs()
    for tok, lp in ((10, -0.5), (11, -1.5), (12, -2.5)):  # logprobs=0: one entry per position, the sampled token's
        flat.append({tok: logprobs.Logprob(lp, rank=1)})
    assert sampled_logprobs([10, 11, 12], flat) == [-0.5, -1.5, -2.5]
    # Top-k entries too: the sampled token's is found by id wherever it sits.
    wide = logprobs.FlatLogprobs()
    wide.append({10: logprobs.Logprob(-0.5, rank=2), 7: logprobs.Logprob(-0.1, rank=1)})
    wide.append({3: logprobs.Logprob(-0.2, rank=1), 11: logprobs.Logprob(-1.5, rank=4)})
    assert sampled_logprobs([10, 11], wide) == [-0.5, -1.5]
    with pytest.raises(ValueError, match="no logprob for the sampled token 12 at position 1"):
        sampled_logprobs([10, 12], wide)
    dicts = [{10: logprobs.Logprob(-0.5)}, {11: logprobs.Logprob(-1.5)}]
    assert sampled_logprobs([10, 11], dicts) == [-0.5, -1.5]
    assert sampled_logprobs([10, 11], None) == [] and sampled_logprobs([], logprobs.FlatLogprobs()) == []


def test_batch_problems():
    ids = torch.tensor([[5, 6, 7], [8, 9, 0]])
    assert batch_problems({"input_ids": ids, "input_lengths": torch.tensor([3, 2])}, max_model_len=8) == []
    assert (
        "input_lengths must be in [1, 3]"
        in batch_problems({"input_ids": ids, "input_lengths": torch.tensor([0, 4])})[0]
    )
    assert "max_model_len=3" in batch_problems({"input_ids": ids, "input_lengths": torch.tensor([3, 2])}, 3)[0]
    assert (
        "stop_strings has 1 entries"
        in batch_problems({"input_ids": ids, "input_lengths": torch.tensor([3, 2]), "stop_strings": [None]})[0]
    )


def test_engine_environment_and_kv_cache_size(monkeypatch: pytest.MonkeyPatch):
    from rl_vllm.engine_env import EngineRank, prepare_process_env

    def _prepare_process_env(cfg: VllmConfig, on_cpu: bool) -> int | None:
        return prepare_process_env(cfg, on_cpu, EngineRank(0, 1))

    for var in (
        "VLLM_HOST_IP",
        "VLLM_CPU_OMP_THREADS_BIND",
        "VLLM_CPU_KVCACHE_SPACE",
        "VLLM_ENABLE_V1_MULTIPROCESSING",
    ):
        monkeypatch.delenv(var, raising=False)
    assert _prepare_process_env(VllmConfig(), on_cpu=True) == 1024**3  # never "a fraction of host memory"
    assert (
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"],
        os.environ["VLLM_HOST_IP"],
        os.environ["VLLM_CPU_OMP_THREADS_BIND"],
    ) == ("0", "127.0.0.1", "nobind")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    assert _prepare_process_env(VllmConfig(), on_cpu=True) is None  # the variable decides
    assert _prepare_process_env(VllmConfig(kv_cache_space_gb=0.5), on_cpu=True) == 512 * 1024**2
    assert "VLLM_CPU_KVCACHE_SPACE" not in os.environ  # it would override the configured size
    assert _prepare_process_env(VllmConfig(), on_cpu=False) is None  # GPU: gpu_memory_utilization


def test_engine_ranks_of_a_tensor_parallel_engine(monkeypatch: pytest.MonkeyPatch):
    """Bundle 3 of two engines of tensor_parallel_size 2 is rank 1 of engine 1: its own torch.distributed group
    (rank 1 of 2, on the rendezvous port + 1) and the OpenMP cores of both ranks of its engine."""
    from rl_vllm.engine_env import SEGMENT_PREFIX_ENV, EngineRank, omp_threads_bind, prepare_process_env

    for var in (
        "VLLM_CPU_OMP_THREADS_BIND",
        "VLLM_CPU_KVCACHE_SPACE",
        "MASTER_ADDR",
        "VLLM_HOST_IP",
        SEGMENT_PREFIX_ENV,
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # restored after: the test sets it
    for var, value in {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3", "MASTER_PORT": "30000"}.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    place = EngineRank(3, 2)
    assert (place.engine, place.tp_rank) == (1, 1)
    prepare_process_env(VllmConfig(tensor_parallel_size=2), True, place)
    env = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "VLLM_CPU_OMP_THREADS_BIND")}
    assert env == {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "MASTER_PORT": "30001",
        "VLLM_CPU_OMP_THREADS_BIND": "2|3",
    }
    assert omp_threads_bind(EngineRank(0, 2), 1, [0, 1]) == "0|1"  # this machine: one core per rank
    assert omp_threads_bind(EngineRank(2, 2), 2, [0, 1, 2]) == "1,2|0,1"  # engine 1; fewer cores than asked: shared


# --------------------------------------------------------------------------- KV-cache shortfall


def test_kv_shortfall_counts_blocks_of_each_sequence_grown_to_its_limit() -> None:
    from rl_vllm.kv_capacity import KvCapacity

    cache = KvCapacity(num_blocks=10, block_size=128, max_num_seqs=256)
    # 300 + 100 tokens = 4 blocks each (ceil(400 / 128)); 2 sequences fit in 10 blocks, 3 do not.
    assert cache.blocks_needed([300, 300], [100, 100]) == 8
    assert cache.shortfall([300, 300], [100, 100], 0.25) is None
    message = cache.shortfall([300, 300, 300], [100, 100, 100], 0.25)
    assert message is not None
    assert "needs up to 12 KV-cache blocks of 128 tokens" in message and "holds 10" in message
    assert "kv_cache_space_gb from 0.25 to about 0.3," in message  # 0.25 * 12 / 10
    assert "gpu_memory_utilization" in cache.shortfall([300] * 3, [100] * 3, None)


def test_kv_shortfall_counts_only_the_sequences_scheduled_together() -> None:
    from rl_vllm.kv_capacity import KvCapacity

    cache = KvCapacity(num_blocks=8, block_size=16, max_num_seqs=2)
    # the two largest run together: ceil(40/16) + ceil(33/16) = 3 + 3; the rest wait by the scheduler's design
    assert cache.blocks_needed([30, 1, 20, 1], [10, 1, 13, 1]) == 6
    assert cache.shortfall([30, 1, 20, 1], [10, 1, 13, 1], 1.0) is None
