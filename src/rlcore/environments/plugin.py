"""Registers the built-in environments through the public hook (light: imports nothing they need)."""

from rlcore.plugins import EnvironmentSpec, hookimpl

_BUILTIN = {
    "digits": ("digits:DigitsEnvironment", None, "The toy task: the fraction of the completion that is digits."),
    "math": (
        "math_env:MathEnvironment",
        "math_env:MathConfig",
        "1 when the completion's final answer (the last \\boxed{}, else the last number) equals ground_truth as "
        "math; uses math-verify when installed (pip install 'rlcore[math]').",
    ),
    "exact_match": (
        "matching:ExactMatchEnvironment",
        "matching:ExactMatchConfig",
        "1 when the completion equals ground_truth (after stripping; case optional).",
    ),
    "regex": (
        "matching:RegexEnvironment",
        "matching:RegexConfig",
        "1 when a pattern's last match (its first group) equals ground_truth, or simply matches.",
    ),
    "guessing": (
        "guessing:GuessingEnvironment",
        None,
        "Multi-turn toy: guess a hidden digit (ground_truth), told higher or lower; reward: the last "
        "guess's closeness.",
    ),
    "python": (
        "python_reward:PythonRewardEnvironment",
        "python_reward:PythonRewardConfig",
        "A 'module:function' reward(prompts, completions, metadata=..., **kwargs) -> list[float], or a "
        "dict of named rewards (their sum; the components GDPO reads).",
    ),
    "tools": (
        "tools:ToolsEnvironment",
        "tools_config:ToolsConfig",
        "Multi-turn tool use: the model's tool calls (hermes format by default) run in a sandboxed process and "
        "their results come back as tool messages; its final answer is graded against ground_truth as math.",
    ),
    "vlm": (
        "vlm_rewards:VlmRewardsEnvironment",
        "vlm_rewards:VlmRewardsConfig",
        "NeMo-RL's VLM environment: a weighted sum of answer checks (format tags, exact_alnum, math_expr, "
        "bbox_giou, geo3k), each a named reward component (docs/vision.md).",
    ),
    "reward_model": (  # it starts a Policy on Ray workers of its own: it lives above them, with reward models
        "rlcore.algorithms.rm.environment:RewardModelEnvironment",
        "rlcore.algorithms.rm.environment_config:RewardModelConfig",
        "A reward model on Ray workers of its own scores each conversation: the reward is its score at the "
        "last token (NeMo-RL's env.reward_model; an rm run's checkpoint or a Hugging Face reward model).",
    ),
    "agent": (
        "rlcore.serving.agent_environment:AgentFunctionEnvironment",
        "rlcore.serving.agent_environment:AgentFunctionConfig",
        "An agent program: 'module:function' naming async def f(endpoint, sample) -> float | AgentOutcome, which "
        "talks to the policy over the run's OpenAI-compatible endpoint (docs/agents.md).",
    ),
}


@hookimpl
def rlcore_register_environments(register):
    for name, (env_class, config_class, description) in _BUILTIN.items():
        register(
            EnvironmentSpec(
                name=name,
                environment_class=_where(env_class),
                config_class=_where(config_class) if config_class else None,
                description=description,
            )
        )


def _where(path: str) -> str:
    """A built-in's ``module:Class``: relative to rlcore.environments unless it names its package."""
    return path if path.startswith("rlcore.") else f"rlcore.environments.{path}"
