"""The ``python`` environment: a reward function named by import path, for users who only want a function."""

from __future__ import annotations

import inspect
from typing import Any

from pydantic import Field

from rlcore.config.base import StrictModel
from rlcore.environments.scoring import last_completion, last_prompt
from rlcore.interfaces.environment import EnvironmentReturn, Message


class PythonRewardConfig(StrictModel):
    reward: str = Field(
        description="'module:function' called as fn(prompts, completions, **kwargs) -> list[float]; "
        "a function with a 'metadata' parameter (or **kwargs) also gets each sample's metadata "
        "(its row, with the expected answer as 'ground_truth'). It may instead return named "
        "rewards, {name: list[float]}: each sample's reward is their sum and the names are the "
        "reward components GDPO reads (grpo.advantage_estimator: gdpo)."
    )
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Extra keyword arguments of the function.")


def takes_metadata(fn: Any) -> bool:
    """Whether ``fn`` accepts ``metadata=`` (by name or through ``**kwargs``)."""
    params = inspect.signature(fn).parameters.values()
    return any(p.name == "metadata" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


class PythonRewardEnvironment:
    """Calls the function once per batch with the prompts (the last user message) and completions."""

    def __init__(self, config: PythonRewardConfig) -> None:
        from rlcore.plugins import import_object

        self.fn = import_object(config.reward)
        self.kwargs = dict(config.kwargs)
        self._with_metadata = takes_metadata(self.fn)

    def step(self, message_logs: list[list[Message]], metadata: list[dict[str, Any]]) -> EnvironmentReturn:
        prompts = [last_prompt(log) for log in message_logs]
        completions = [last_completion(log) for log in message_logs]
        extra = {"metadata": metadata} if self._with_metadata else {}
        scores = self.fn(prompts, completions, **extra, **self.kwargs)
        if isinstance(scores, dict):  # named rewards: their sum is the reward
            return EnvironmentReturn.from_components(scores, metadata)
        rewards = list(scores)
        if len(rewards) != len(completions):
            raise ValueError(f"the reward function returned {len(rewards)} rewards for {len(completions)} completions")
        return EnvironmentReturn.final(rewards, metadata)
