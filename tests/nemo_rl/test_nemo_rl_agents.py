"""NeMo-RL's agent keys: the OpenAI-compatible endpoint, its tool parser, the invalid-tool-call advantage, and
NeMo-Gym, which needs a Python these machines lack."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlcore.config import ConfigError
from rlcore.nemo_rl import load_nemo_rl_config

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "nemo_rl"
MAIN = FIXTURES / "main" / "grpo_math_1B.yaml"
LOCAL_DATA = f"++data.train.data_path={FIXTURES / 'math.jsonl'}"
SERVING = "++policy.generation.vllm_cfg.http_server_serving_chat_kwargs"


def test_the_endpoint_and_the_tool_call_penalty_convert():
    config = load_nemo_rl_config(
        MAIN,
        [
            LOCAL_DATA,
            "policy.generation.vllm_cfg.async_engine=true",
            "++policy.generation.vllm_cfg.expose_http_server=true",
            "grpo.invalid_tool_call_advantage=-5.0",
            f"{SERVING}.tool_parser=hermes",
            f"{SERVING}.enable_auto_tools=true",
        ],
        [],
    ).config
    generation = config.policy.generation
    assert (generation.expose_http_server, generation.tool_call_parser) == (True, "hermes")
    assert config.grpo.invalid_tool_call_advantage == -5.0


def test_nemo_rls_default_keeps_the_endpoint_off_and_advantages_untouched():
    config = load_nemo_rl_config(MAIN, [LOCAL_DATA], []).config
    assert config.policy.generation.expose_http_server is False
    assert config.grpo.invalid_tool_call_advantage is None


@pytest.mark.parametrize(
    "override, line",
    [
        (
            "++data.train.env_name=nemo_gym",
            "data.train.env_name: is 'nemo_gym', NeMo-Gym, which needs Python >= 3.12",
        ),
        (
            f"{SERVING}.reasoning_parser=deepseek_r1",
            "http_server_serving_chat_kwargs.reasoning_parser: is 'deepseek_r1', but rlcore does not support "
            "reasoning parsers on the endpoint",
        ),
    ],
)
def test_what_the_endpoint_cannot_do_is_refused_in_one_line(override, line):
    with pytest.raises(ConfigError) as info:
        load_nemo_rl_config(MAIN, [LOCAL_DATA, override], [])
    assert any(line in problem for problem in info.value.problems), info.value.problems
