"""The built-in ``agent`` environment: an async function named by import path is the agent.

``env.agent_cfg.function: "module:function"`` names ``async def f(endpoint, sample) -> float | AgentOutcome``: it
chats with the policy at ``endpoint`` (an :class:`rlcore.interfaces.agent.OpenAIEndpoint`) about ``sample`` (an
:class:`rlcore.interfaces.agent.AgentSample`) and returns the episode's reward (docs/agents.md).
"""

from __future__ import annotations

import inspect
from typing import Any

from pydantic import Field

from rlcore.config.base import StrictModel
from rlcore.interfaces.agent import AgentOutcome, AgentSample, OpenAIEndpoint


class AgentFunctionConfig(StrictModel):
    function: str = Field(
        description="'module:function' naming async def f(endpoint, sample) -> float | AgentOutcome: one episode "
        "of an agent talking to the policy through endpoint.async_client() (an OpenAI client), scored."
    )
    tools: list[dict[str, Any]] | None = Field(
        None, description="OpenAI function-tool schemas the samples declare (each AgentSample's tools)."
    )
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Extra keyword arguments of the function.")


class AgentFunctionEnvironment:
    """Runs each episode by awaiting the configured function."""

    def __init__(self, config: AgentFunctionConfig) -> None:
        from rlcore.plugins import import_object

        self.fn = import_object(config.function)
        if not inspect.iscoroutinefunction(self.fn):
            raise TypeError(
                f"env.agent_cfg.function: {config.function} is not an async function; define it as "
                "async def f(endpoint, sample) -> float | AgentOutcome"
            )
        self.tools = list(config.tools) if config.tools else None
        self.kwargs = dict(config.kwargs)

    async def run_episode(self, endpoint: OpenAIEndpoint, sample: AgentSample) -> AgentOutcome:
        result = await self.fn(endpoint, sample, **self.kwargs)
        if isinstance(result, AgentOutcome):
            return result
        if isinstance(result, (int, float)) and not isinstance(result, bool):
            return AgentOutcome(float(result))
        raise TypeError(f"the agent function returned {type(result).__name__}, not a float or an AgentOutcome")
