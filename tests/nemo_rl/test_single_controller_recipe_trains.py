"""NeMo-RL main's single-controller recipe (grpo_math_1B_megatron_single_controller.yaml) trains on CPU.

The recipe is converted as written: megatron-core training, a vLLM engine on its own resources with
``vllm_cfg.async_engine: true``, and the single-controller ``async_rl`` section (``in_order`` sampler, one version
of lookahead), which becomes asynchronous GRPO with in-flight weight updates (rlcore.nemo_rl.data_plane). Only
these overrides:

- model: the built-in tiny Qwen2 (built locally);
- sizes: the recipe's own layout (2 devices, 1 for the engine, so 1 CPU training rank beside 1 engine), small
  batches and lengths, a few steps;
- data: the local math rows of tests/fixtures/nemo_rl/math.jsonl and the prompt file beside them;
- where the run writes (``logger.log_dir``).

The tiny random model never writes a correct answer, so the test shows the machinery (the engine serving sample
groups continuously, refits landing while requests run, the age rule on each sample's oldest span), not learning.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

FIXTURES = Path(__file__).parents[1] / "fixtures" / "nemo_rl"
RECIPE = FIXTURES / "main" / "grpo_math_1B_megatron_single_controller.yaml"
STEPS = 3


def recipe_overrides(out: Path) -> list[str]:
    """NeMo-RL (Hydra) overrides of the recipe: model, sizes, data, where the run writes; no CPU-only ones."""
    return [
        # model
        "policy.model_name=tiny-qwen2",
        # sizes
        "grpo.num_prompts_per_step=4",
        "grpo.num_generations_per_prompt=4",
        f"grpo.max_num_steps={STEPS}",
        "policy.train_global_batch_size=16",
        "policy.train_micro_batch_size=4",
        "policy.logprob_batch_size=8",
        "policy.max_total_sequence_length=192",
        "policy.generation.max_new_tokens=48",
        # data
        f"++data.train.data_path={FIXTURES / 'math.jsonl'}",
        f"data.default.prompt_file={FIXTURES / 'cot.txt'}",
        # where the run writes
        f"logger.log_dir={out}",
    ]


RLCORE_OVERRIDES = ["cluster.use_gpu=false", "logger.progress_bar=false"]


def load(out: Path) -> Any:
    from rlcore.nemo_rl import load_nemo_rl_config

    return load_nemo_rl_config(RECIPE, recipe_overrides(out), RLCORE_OVERRIDES)


def test_the_recipe_resolves_for_cpu_as_written(tmp_path: Path) -> None:
    """With only model, size, data and output overrides the recipe resolves and passes ``rlcore run``'s preflight:
    asynchronous GRPO, in-flight weight updates, the async engine, megatron training, generation on its own
    resources, and NeMo-RL's uncorrected importance weights (a notice, as its single-controller loop trains)."""
    from rlcore.config import resolve
    from rlcore.preflight import preflight, problem_lines

    loaded = load(tmp_path)
    resolved = resolve(loaded.config, run=True)
    assert problem_lines(preflight(resolved, sources=loaded.conversion.sources)) == []
    cfg = resolved.config
    a = cfg.grpo.async_grpo
    assert (a.enabled, a.max_trajectory_age_steps, a.in_flight_weight_updates) == (True, 1, True)
    assert a.recompute_kv_cache_after_weight_updates is False and a.in_flight_pause_mode == "keep"
    assert resolved.async_generation is True
    assert resolved.policy.spec.name == "megatron" and resolved.generation.spec.name == "vllm"
    assert resolved.generation.section.async_engine is True
    assert cfg.policy.generation.colocated.enabled is False
    assert any("trained as if on-policy" in n for n in resolved.notices), resolved.notices


@pytest.mark.slow  # ~2-4 min on 2 cores: a megatron rank beside a vLLM engine, 3 steps
def test_the_recipe_trains_with_refits_landing_in_flight(ray_session: None, tmp_path: Path) -> None:
    from rlcore.config import resolve
    from rlcore.run.train import train

    out = tmp_path / "run"
    summary = train(resolve(load(out).config, run=True))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r.get("step", -1) >= 0 and "loss" in r]
    assert summary["steps"] == STEPS and [r["step"] for r in steps] == list(range(STEPS)), rows
    # the age rule, on each sample's oldest span: rollout 0 on v0, later ones at most one version older
    assert [r["async/age_max"] for r in steps] == [0, 1, 1], [r["async/age_max"] for r in steps]
    assert all(r["async/regenerated_rollouts"] == 0 for r in steps)
    # a step with a refit after it reports how busy the engine was (the last step has none)
    assert all(0.0 < r["async/engine_busy_fraction"] <= 1.0 for r in steps[1:-1])
    assert all(0.0 <= r["async/mixed_version_samples_fraction"] <= 1.0 for r in steps)
    # the engine's logprobs of the first rollout (on the trained weights) equal the policy's
    assert abs(steps[0]["token_mult_prob_error"] - 1.0) < 0.05, steps[0]["token_mult_prob_error"]
