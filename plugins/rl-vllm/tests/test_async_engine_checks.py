"""``vllm_cfg.async_engine`` before anything starts: in-flight weight updates need it (one line naming the key and
the fix), and a tensor-parallel engine cannot run the engine loop (refused when the section is validated)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rl_vllm.checks import check_in_flight_updates
from rl_vllm.config import VllmConfig
from rlcore.config import load_config, resolve

TINY = str(Path(__file__).parents[3] / "src" / "rlcore" / "examples" / "grpo_tiny.yaml")


def resolved(*overrides: str):
    return resolve(load_config(TINY, ["policy.generation.backend=vllm", *overrides]), run=False)


def test_in_flight_weight_updates_without_the_async_engine_are_refused_in_one_line() -> None:
    pytest.importorskip("rlcore.algorithms.grpo.config").AsyncGRPOConfig.model_fields.get(
        "in_flight_weight_updates"
    ) or pytest.skip("grpo.async_grpo.in_flight_weight_updates is not in rlcore yet")
    in_flight = [
        "grpo.async_grpo.enabled=true",
        "grpo.async_grpo.in_flight_weight_updates=true",
        "policy.generation.colocated={enabled: false, resources: {workers_per_node: 1}}",
        "loss.use_importance_sampling_correction=true",
    ]
    line = check_in_flight_updates(resolved(*in_flight))
    assert line is not None and line.status == "fail" and "\n" not in line.message
    assert line.message.startswith(
        "grpo.async_grpo.in_flight_weight_updates: true needs policy.generation.vllm_cfg.async_engine: true"
    )
    assert check_in_flight_updates(resolved(*in_flight, "policy.generation.vllm_cfg.async_engine=true")) is None
    assert check_in_flight_updates(resolved()) is None


def test_a_tensor_parallel_async_engine_is_refused() -> None:
    with pytest.raises(ValueError, match="async_engine: true with tensor_parallel_size=2"):
        VllmConfig(async_engine=True, tensor_parallel_size=2)
