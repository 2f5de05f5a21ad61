"""NeMo-RL main's Qwen3-30B-A3B recipe (grpo_math_qwen30ba3b_megatron.yaml) trains 2 GRPO steps on 2 CPU ranks.

The recipe is converted as written (megatron-core, TP 2 + sequence parallel, expert parallelism, the MoE router
settings, vLLM with ``vllm_kwargs.moe_backend: triton``, verified refit) with only these overrides:

- model: the built-in tiny Qwen3-MoE (8 experts, top-2), built locally;
- sizes: 2 CPU ranks (``cluster.use_gpu=false``), expert parallel 2 (8 in the recipe: there are 2 ranks), one vLLM
  engine per rank (tensor_parallel_size 4 needs 4 bundles), small batches and lengths, 2 steps;
- data: the local math rows of tests/fixtures/nemo_rl/math.jsonl and the prompt file beside them;
- where the run writes: ``logger.log_dir``, and ``checkpointing.enabled=true`` (the recipe saves none; the
  megatron checkpoint is where the test reads which rank holds which experts);
- nothing for CPU: bf16 with float32 main weights and megatron-core's distributed optimizer run on CPU
  (rl_megatron.cpu_compat), and the recipe's precision-aware optimizer, whose state is float32 here, runs as the
  distributed optimizer it then is, with one ``ignored:`` line (TransformerEngine's FusedAdam is GPU-only).

The tiny random model never writes a correct answer, so every reward is 0 and the policy gradient is ~0: the test
shows the recipe's machinery running (TP 2 + SP + EP 2 steps, verified refits, engine logprobs equal to the
policy's), not learning.

``vllm_kwargs.moe_backend: triton`` stays: it picks a kernel for the same MoE computation, and on vLLM's CPU
platform rl-vllm drops it with one warning line (rl_vllm.config.CPU_IGNORED_ENGINE_KWARGS) instead of the engine
dying ("kernel does not support current device cpu").
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

FIXTURES = Path(__file__).parents[1] / "fixtures" / "nemo_rl"
RECIPE = FIXTURES / "main" / "grpo_math_qwen30ba3b_megatron.yaml"
STEPS = 2


def recipe_overrides(out: Path) -> list[str]:
    """NeMo-RL (Hydra) overrides of the recipe: model, sizes, data, where the run writes; no CPU-only ones."""
    return [
        # model
        "policy.model_name=tiny-qwen3-moe",
        # sizes
        "cluster.gpus_per_node=2",
        "cluster.num_nodes=1",
        "policy.megatron_cfg.expert_model_parallel_size=2",
        "policy.generation.vllm_cfg.tensor_parallel_size=1",
        "grpo.num_prompts_per_step=4",
        "grpo.num_generations_per_prompt=4",
        f"grpo.max_num_steps={STEPS}",
        "policy.train_global_batch_size=16",
        "policy.logprob_batch_size=8",
        "policy.max_total_sequence_length=192",
        "policy.generation.max_new_tokens=24",
        # data
        f"++data.train.data_path={FIXTURES / 'math.jsonl'}",
        f"data.default.prompt_file={FIXTURES / 'cot.txt'}",
        # where the run writes
        f"logger.log_dir={out}",
        "checkpointing.enabled=true",  # the recipe saves none; its megatron checkpoint shows the expert layout
    ]


RLCORE_OVERRIDES = ["cluster.use_gpu=false", "logger.progress_bar=false"]


def load(out: Path, extra: list[str]) -> Any:
    from rlcore.nemo_rl import load_nemo_rl_config

    return load_nemo_rl_config(RECIPE, [*recipe_overrides(out), *extra], RLCORE_OVERRIDES)


MOE_BACKEND_DROPPED = r"ignored: policy\.generation\.vllm_cfg\.engine_kwargs\.moe_backend='triton' on vLLM's CPU"
PRECISION_AWARE_AS_DISTRIBUTED = r"ignored: policy\.megatron_cfg\.optimizer\.use_precision_aware_optimizer=true"


def test_the_recipe_resolves_for_cpu_as_written(tmp_path: Path) -> None:
    """With only model, size, data and output overrides the recipe resolves and passes ``rlcore run``'s preflight
    on CPU: the two kernel choices CPU has no kernel for are dropped, one ``ignored:`` line each, and what the
    recipe trains with (bf16, TP 2 + SP, EP 2, the distributed optimizer, verified refit) is kept."""
    from rlcore.config import resolve
    from rlcore.preflight import preflight, problem_lines

    loaded = load(tmp_path, [])
    with pytest.warns(UserWarning) as warned:
        resolved = resolve(loaded.config, run=True)
    lines = [str(w.message) for w in warned]
    for dropped in (MOE_BACKEND_DROPPED, PRECISION_AWARE_AS_DISTRIBUTED):
        assert any(re.match(dropped, line) for line in lines), lines
    assert problem_lines(preflight(resolved, sources=loaded.conversion.sources)) == []
    megatron = resolved.policy.section
    assert (megatron.tensor_model_parallel_size, megatron.expert_model_parallel_size) == (2, 2)
    assert megatron.sequence_parallel is True and resolved.generation.verify_refit is True
    assert resolved.config.policy.precision == "bfloat16" and megatron.optimizer.use_distributed_optimizer
    assert "moe_backend" not in resolved.generation.section.engine_kwargs


def experts_by_rank(checkpoint: Path) -> dict[int, set[int]]:
    """Which experts' ``linear_fc1`` weights each rank wrote into a megatron distributed checkpoint (DCP files are
    ``__<rank>_<n>.distcp``), read from its ``.metadata`` without unrestricted pickle (rl_megatron.safe_load)."""
    from rl_megatron.safe_load import SafeMetadataReader

    metadata = SafeMetadataReader(str(checkpoint)).read_metadata()
    held: dict[int, set[int]] = {}
    for index, info in metadata.storage_data.items():
        if index.fqn == "decoder.layers.mlp.experts.experts.linear_fc1.weight":  # [layer, expert, rows, hidden]
            rank = int(info.relative_path.split("_")[2])
            held.setdefault(rank, set()).add(index.offset[1])
    return held


@pytest.mark.slow  # ~3-5 min on 2 cores: 2 megatron ranks (TP 2 + SP + EP 2) beside 2 vLLM engines, 2 steps
def test_the_recipe_trains_two_steps_at_expert_parallel_2_with_verified_refit(
    ray_session: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rlcore.config import resolve
    from rlcore.refit import fingerprint
    from rlcore.run.train import train

    verified: list[tuple[int, int]] = []  # (weight version, tensors compared per engine) of each refit
    compare = fingerprint.verify_engines

    def verify_and_count(sent: Any, reports: Any, *, version: int, **kwargs: Any) -> None:
        reports = list(reports)
        compare(sent, reports, version=version, **kwargs)  # raises on any mismatch: the run would fail
        verified.append((version, min(len(s) for s in sent)))

    monkeypatch.setattr(fingerprint, "verify_engines", verify_and_count)
    out = tmp_path / "run"
    loaded = load(out, [])
    with pytest.warns(UserWarning, match=MOE_BACKEND_DROPPED):
        resolved = resolve(loaded.config, run=True)
    summary = train(resolved)

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r.get("step", -1) >= 0 and "loss" in r]
    assert summary["steps"] == STEPS and [r["step"] for r in steps] == list(range(STEPS)), rows
    # the engines' logprobs of what they sampled match the policy's (bf16 policy and engine, as the recipe says)
    assert all(1.0 <= r["token_mult_prob_error"] < 1.05 for r in steps), [r["token_mult_prob_error"] for r in steps]
    # the recipe's moe_router_load_balancing_type 'none' (NeMo-RL: "seq_aux_loss causes logprob error divergence
    # for grpo"): no load-balancing loss is added, so none is reported
    assert resolved.policy.section.moe_router_load_balancing_type == "none"
    assert not any("moe_aux_loss" in r for r in steps), steps
    # a verified refit before each step's generation, covering every tensor of the Hugging Face checkpoint
    from safetensors import safe_open

    [last] = sorted((out / "checkpoints").glob("step_*"))
    with safe_open(str(last / "weights" / "model.safetensors"), framework="pt") as f:
        tensors = len(list(f.keys()))
    assert verified == [(version, tensors) for version in range(STEPS)], (verified, tensors)
    # expert parallel 2 (and TP 2) as the workers ran it: rank 0 wrote experts 0-3, rank 1 experts 4-7
    info = json.loads((last / "optimizer" / "rlcore_megatron.json").read_text())
    assert (info["expert_model_parallel_size"], info["tensor_model_parallel_size"]) == (2, 2), info
    assert experts_by_rank(last / "optimizer") == {0: {0, 1, 2, 3}, 1: {4, 5, 6, 7}}
