"""The vllm backend against real engines in real Ray actors, on CPU, with a tiny float32 Llama.

Everything runs on one set of two data-parallel engines (the conformance
kit's class-scoped ``generation`` fixture), so the engines start once. Tests
that need other sampling settings swap ``engine.cfg`` (read at every call)
and put it back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from rl_vllm.generation import VllmGeneration
from rl_vllm.worker import CPU_BLOCK_SIZE
from rlcore.data import BatchedDataDict
from rlcore.testing.conformance import GenerationBackendConformance, generation_output_problems, load_hf_model
from rlcore.testing.models import BYTE_OFFSET, make_batch
from rlcore.training.logprobs import token_logprobs

MAX_NEW = 8
ATOL = 1e-4


@contextlib.contextmanager
def sampling(engine: VllmGeneration, **changes: Any) -> Iterator[None]:
    """Run the block with some ``GenerationConfig`` sampling fields changed."""
    saved = engine.cfg
    engine.cfg = saved.model_copy(update=changes)
    try:
        yield
    finally:
        engine.cfg = saved


def prompts(tokenizer: Any, n: int, seed: int) -> BatchedDataDict:
    raw = make_batch(tokenizer, n, 3, 8, seed=seed)
    return BatchedDataDict(input_ids=raw["input_ids"], input_lengths=raw["input_lengths"])


def generated(out: BatchedDataDict, data: BatchedDataDict) -> list[list[int]]:
    """Generated tokens of each row."""
    return [
        out["output_ids"][i, int(p) : int(n)].tolist()
        for i, (p, n) in enumerate(zip(data["input_lengths"], out["unpadded_sequence_lengths"]))
    ]


def generated_mask(out: BatchedDataDict, data: BatchedDataDict) -> torch.Tensor:
    positions = torch.arange(out["output_ids"].shape[1])[None, :]
    return (positions >= data["input_lengths"][:, None]) & (positions < out["unpadded_sequence_lengths"][:, None])


def hf_logits(model: Any, out: BatchedDataDict) -> torch.Tensor:
    ids, lens = out["output_ids"], out["unpadded_sequence_lengths"]
    valid = torch.arange(ids.shape[1])[None, :] < lens[:, None]
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=valid.long()).logits.float()


def cut_at_stop(tokens: list[int], stop_chars: str) -> list[int]:
    """``tokens`` up to and including the first one that is one of the (ASCII) ``stop_chars``."""
    stop_ids = {BYTE_OFFSET + ord(c) for c in stop_chars}
    for k, tok in enumerate(tokens):
        if tok in stop_ids:
            return tokens[: k + 1]
    return tokens


def ascii_chars(tokens: list[int]) -> list[str]:
    return [chr(t - BYTE_OFFSET) for t in tokens if 0x21 <= t - BYTE_OFFSET <= 0x7E]


class TestVllmBackend(GenerationBackendConformance):
    """The generation conformance kit, plus the backend's own checks on the same engines."""

    backend_name = "vllm"
    world_size = 2  # two data-parallel engines: results must come back in the caller's order
    max_new_tokens = MAX_NEW

    def generation_overrides(self) -> dict:
        return {"vllm_cfg": {"kv_cache_space_gb": 0.0625, "max_model_len": 128}}

    def make_generation(self, cluster: Any, config: Any) -> Any:
        return VllmGeneration(cluster, config)

    @pytest.fixture(scope="class")
    @classmethod
    def hf_model(cls, generation: dict) -> Any:
        return load_hf_model(generation["model_dir"])

    # -- engines ----------------------------------------------------------------------------
    def test_engines_started_in_process(self, generation: dict) -> None:
        infos = generation["engine"].engine_info
        assert [i["rank"] for i in infos] == [0, 1]
        assert len({i["pid"] for i in infos}) == 2
        print(
            "engine start seconds:",
            [round(i["start_seconds"], 2) for i in infos],
            "import vllm seconds:",
            [round(i["import_seconds"], 2) for i in infos],
        )

    def test_engines_report_the_kv_cache_they_allocated(self, generation: dict) -> None:
        """The block count the shortfall warning reads is the cache's real size: kv_cache_space_gb over
        one block's bytes (K and V of every layer's KV heads, float32), computed here from the model config."""
        import json
        from pathlib import Path

        config = json.loads((Path(generation["model_dir"]) / "config.json").read_text())
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        token_bytes = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4
        for info in generation["engine"].engine_info:
            assert info["kv_block_size"] == CPU_BLOCK_SIZE  # not vLLM's CPU default of 128 (see CPU_BLOCK_SIZE)
            block_bytes = token_bytes * info["kv_block_size"]
            assert info["kv_cache_blocks"] == int(0.0625 * 2**30) // block_bytes, info

    def test_prepare_and_finish_generation_are_noops_on_cpu(self, generation: dict) -> None:
        engine = generation["engine"]
        assert engine.finish_generation() is True
        assert engine.prepare_for_generation() is True

    def test_vllm_s_compiled_helpers_run_eagerly_on_cpu(self, generation: dict, greedy_output: tuple) -> None:
        """enforce_eager on CPU: a generation with logprobs compiles nothing in the engines (vLLM's sampler would
        compile its logprob ranks with inductor, C++ built at the first generation: ~11 s per engine start)."""
        if torch.cuda.is_available():
            pytest.skip("on a GPU vLLM's compiled helpers stay compiled")
        assert [info["compiled_frames"] for info in generation["engine"]._all("info")] == [0, 0]

    # -- greedy -------------------------------------------------------------------------------
    def test_greedy_equals_hf_generate(self, generation: dict, greedy_output: tuple, hf_model: Any) -> None:
        data, out = greedy_output
        ours = generated(out, data)
        for i, n in enumerate(data["input_lengths"].tolist()):
            prompt = data["input_ids"][i : i + 1, :n]
            with torch.no_grad():
                ref = hf_model.generate(
                    prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=MAX_NEW, do_sample=False
                )
            assert ours[i] == ref[0, n:].tolist(), f"row {i}: vllm {ours[i]} != HF {ref[0, n:].tolist()}"

    def test_greedy_logprobs_equal_policy_logprobs(
        self, generation: dict, greedy_output: tuple, make_cluster: Any
    ) -> None:
        """The reference training backend's ``get_logprobs`` of the generated sequences, index by index."""
        from rlcore.config import load_config_dict
        from rlcore.policy import Policy

        data, out = greedy_output
        cfg = load_config_dict(
            {
                "cluster": {"workers_per_node": 1},
                "policy": {
                    "backend": "reference",
                    "model_name": generation["model_dir"],
                    "precision": "float32",
                    "max_total_sequence_length": 64,
                },
            }
        ).policy
        policy = Policy(
            make_cluster(1),
            cfg,
            generation["tokenizer"],
            name_prefix="vllm-test-ref",
            init_optimizer=False,
            init_reference_model=False,
        )
        try:
            seqs = BatchedDataDict(input_ids=out["output_ids"], input_lengths=out["unpadded_sequence_lengths"])
            expected = policy.get_logprobs(seqs)["logprobs"]
        finally:
            policy.shutdown()
        mask = generated_mask(out, data)
        err = float(((out["logprobs"] - expected).abs() * mask).max())
        assert err <= ATOL, f"generation logprobs differ from the policy's by {err:.3g}"
        mult_prob_error = float((out["logprobs"] - expected)[mask].exp().mean())
        assert abs(mult_prob_error - 1.0) <= ATOL

    def test_rows_come_back_in_order_whatever_the_split(self, generation: dict, greedy_output: tuple) -> None:
        engine = generation["engine"]
        data, out = greedy_output
        reverse = list(range(data.size))[::-1]
        again = engine.generate(data.select_indices(reverse), greedy=True)
        assert torch.equal(again["output_ids"], out["output_ids"][reverse])
        # Three prompts over two engines, then one (the second engine gets nothing).
        for rows in ([0, 1, 2], [3]):
            part = engine.generate(data.select_indices(rows), greedy=True)
            assert torch.equal(part["output_ids"], out["output_ids"][rows])
            assert torch.allclose(part["logprobs"], out["logprobs"][rows], atol=ATOL)

    # -- sampling -------------------------------------------------------------------------------
    @pytest.mark.parametrize("temperature, top_k", [(0.7, None), (1.3, 20)])
    def test_sampled_logprobs_are_the_sampling_distribution(
        self, generation: dict, hf_model: Any, temperature: float, top_k: int | None
    ) -> None:
        """Logprobs at T (and after top-k) equal HF's logprobs of logits / T, renormalised over the top k."""
        engine, tokenizer = generation["engine"], generation["tokenizer"]
        data = prompts(tokenizer, 6, seed=11)
        with sampling(engine, temperature=temperature, top_k=top_k):
            out = engine.generate(data, greedy=False)
        problems = generation_output_problems(
            data["input_ids"], data["input_lengths"], out, MAX_NEW, tokenizer.pad_token_id
        )
        assert not problems, "\n".join(problems)
        logits = hf_logits(hf_model, out)
        if top_k is not None:
            kth = logits.topk(top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        expected = token_logprobs(logits, out["output_ids"], out["unpadded_sequence_lengths"], temperature)
        mask = generated_mask(out, data)
        err = float((out["logprobs"] - expected)[mask].abs().max())  # -inf outside the top k: index, not mask
        assert err <= ATOL, f"sampled logprobs differ from temperature-scaled HF logprobs by {err:.3g}"
        # Sampling really happened: unscaled logprobs are different numbers.
        plain = token_logprobs(hf_logits(hf_model, out), out["output_ids"], out["unpadded_sequence_lengths"])
        assert float((out["logprobs"] - plain)[mask].abs().max()) > 1e-3

    # -- stops ----------------------------------------------------------------------------------
    def test_per_sample_stop_strings_cut_after_the_stop(self, generation: dict, greedy_output: tuple) -> None:
        engine = generation["engine"]
        data, out = greedy_output
        full = generated(out, data)
        # For each row, a printable character it generates after its first token (None for some rows).
        stops: list[list[str] | None] = []
        for i, tokens in enumerate(full):
            later = ascii_chars(tokens[1:])
            stops.append([later[0]] if later and i % 3 != 2 else None)
        assert any(stops), "no row generated a printable character to stop on"
        cut = engine.generate(BatchedDataDict({**data, "stop_strings": stops}), greedy=True)
        for i, tokens in enumerate(generated(cut, data)):
            expected = cut_at_stop(full[i], stops[i][0]) if stops[i] else full[i]
            assert tokens == expected, f"row {i} (stop {stops[i]}): {tokens} != {expected}"
        was_cut = torch.tensor([len(e) < len(f) for e, f in zip(generated(cut, data), full)])
        assert not cut["truncated"][was_cut].any()
        problems = generation_output_problems(
            data["input_ids"], data["input_lengths"], cut, MAX_NEW, generation["tokenizer"].pad_token_id
        )
        assert not problems, "\n".join(problems)

    def test_config_stop_strings_and_sample_stop_strings_combine(self, generation: dict, greedy_output: tuple) -> None:
        engine = generation["engine"]
        data, out = greedy_output
        full = generated(out, data)
        chars = [c for tokens in full for c in ascii_chars(tokens)]
        assert len(set(chars)) >= 2, "greedy outputs hold too few printable characters to test stops"
        common, other = sorted(set(chars), key=lambda c: -chars.count(c))[:2]
        per_sample = [[other] if i % 2 else None for i in range(data.size)]
        with sampling(engine, stop_strings=[common]):
            cut = engine.generate(BatchedDataDict({**data, "stop_strings": per_sample}), greedy=True)
        for i, tokens in enumerate(generated(cut, data)):
            stop_chars = common + (other if per_sample[i] else "")
            assert tokens == cut_at_stop(full[i], stop_chars), f"row {i} with stops {stop_chars!r}"

    def test_stop_token_ids_end_generation_and_are_kept(self, generation: dict, greedy_output: tuple) -> None:
        engine = generation["engine"]
        data, out = greedy_output
        full = generated(out, data)
        stop_token = full[0][2]
        with sampling(engine, stop_token_ids=[stop_token]):
            cut = engine.generate(data, greedy=True)
        for i, tokens in enumerate(generated(cut, data)):
            k = full[i].index(stop_token) + 1 if stop_token in full[i] else len(full[i])
            assert tokens == full[i][:k]

    def test_max_new_tokens_truncation_is_reported(self, generation: dict, greedy_output: tuple) -> None:
        engine = generation["engine"]
        data, out = greedy_output
        with sampling(engine, max_new_tokens=3):
            short = engine.generate(data, greedy=True)
        assert short["output_ids"].shape[1] == data["input_ids"].shape[1] + 3
        for i, tokens in enumerate(generated(short, data)):
            assert tokens == generated(out, data)[i][:3]
            assert bool(short["truncated"][i]) == (len(tokens) == 3 and tokens[-1] != 2)

    def test_seeded_prompts_beyond_one_prefill_step_generate_alike(self, generation: dict) -> None:
        """More prompt tokens than vLLM prefills in one step (4096 by default), every request seeded: on CPU a
        prompt prefilled in chunks made vLLM rewind its seeded generator, which a CPU generator cannot
        ('CPU Generator does not use offset'); the engines prefill whole prompts there."""
        engine = generation["engine"]
        rows, width = 80, 120  # 4800 prompt tokens per engine
        data = BatchedDataDict(
            input_ids=torch.randint(3, 200, (rows, width), generator=torch.Generator().manual_seed(5)),
            input_lengths=torch.full((rows,), width),
            sampling_seeds=torch.arange(rows, dtype=torch.long),
        )
        with sampling(engine, max_new_tokens=2):
            first, again = engine.generate(data), engine.generate(data)
        assert first["output_ids"].shape == (rows, width + 2)
        assert torch.equal(first["output_ids"], again["output_ids"])  # seeded: the same draws

    # -- bad input ------------------------------------------------------------------------------
    def test_bad_input_is_rejected_before_it_reaches_the_engines(self, generation: dict, greedy_output: tuple) -> None:
        engine = generation["engine"]
        data, out = greedy_output
        too_long = BatchedDataDict(input_ids=torch.full((1, 130), 40), input_lengths=torch.tensor([130]))
        with pytest.raises(ValueError, match="max_model_len=128"):
            engine.generate(too_long)
        with pytest.raises(ValueError, match="stop_strings has 1 entries"):
            engine.generate(BatchedDataDict({**data, "stop_strings": [None]}))
        assert torch.equal(engine.generate(data, greedy=True)["output_ids"], out["output_ids"])


def test_bfloat16_engine_generates(make_cluster: Any, tiny_model_dir: str, tiny_tokenizer: Any) -> None:
    """A bf16 engine in an actor runs (on AMX CPUs this needs the AMX permission rl-vllm requests)."""
    from rlcore.config import load_config_dict

    config = load_config_dict(
        {
            "policy": {
                "model_name": tiny_model_dir,
                "generation": {
                    "backend": "vllm",
                    "max_new_tokens": 4,
                    "pad_token_id": tiny_tokenizer.pad_token_id,
                    "vllm_cfg": {"precision": "bfloat16", "kv_cache_space_gb": 0.0625, "max_model_len": 64},
                },
            }
        }
    ).policy.generation
    engine = VllmGeneration(make_cluster(1), config, name_prefix="vllm-bf16")
    try:
        data = prompts(tiny_tokenizer, 2, seed=5)
        out = engine.generate(data, greedy=True)
    finally:
        engine.shutdown()
    problems = generation_output_problems(data["input_ids"], data["input_lengths"], out, 4, tiny_tokenizer.pad_token_id)
    assert not problems, "\n".join(problems)
