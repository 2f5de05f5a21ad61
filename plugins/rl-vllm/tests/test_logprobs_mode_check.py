"""``vllm_cfg.logprobs_mode: raw_logprobs`` is refused before a run unless the engine samples the model's own
distribution: raw logprobs are the model's before temperature, top-k and top-p (test_logprobs_mode.py measures
that on a real engine), while the policy's, and GRPO's importance weights, are of the sampling distribution."""

from __future__ import annotations

import pytest

from rl_vllm.checks import check_raw_logprobs
from rlcore.config.generation import GenerationConfig


def generation(**sampling: object) -> GenerationConfig:
    return GenerationConfig.model_validate(
        {"backend": "vllm", "vllm_cfg": {"logprobs_mode": "raw_logprobs"}, **sampling}
    )


@pytest.mark.parametrize(
    "sampling, named",
    [({"temperature": 0.7}, "temperature=0.7"), ({"top_k": 20}, "top_k=20"), ({"top_p": 0.9}, "top_p=0.9")],
)
def test_raw_logprobs_with_shaped_sampling_are_refused_naming_the_setting(sampling: dict, named: str) -> None:
    result = check_raw_logprobs(generation(**sampling))
    assert result is not None and result.status == "fail"
    assert result.message.startswith(f"policy.generation.vllm_cfg.logprobs_mode: 'raw_logprobs' with {named} ")


def test_raw_logprobs_of_the_model_s_own_distribution_and_processed_ones_pass() -> None:
    assert check_raw_logprobs(generation()) is None
    processed = GenerationConfig.model_validate({"backend": "vllm", "temperature": 0.7})
    assert check_raw_logprobs(processed) is None
