"""The agent-environment contract: an agent program that talks to the policy over an OpenAI-compatible endpoint.

An agent environment does not see token ids. For each sample the core serves the engines (with their current
weights) at an OpenAI-compatible URL of the episode's own (``http://127.0.0.1:PORT/rollouts/<rollout_id>/v1``),
calls :meth:`AgentEnvironment.run_episode` with it, and lets the agent chat with the policy for as many turns as
it likes (tools and all) through any OpenAI client. The server keeps the episode's tokens as the engine made them,
so what the trainer sees is what was sampled; the agent returns the episode's reward (docs/agents.md).

An agent environment is registered like any other, with an ``EnvironmentSpec``; the core tells it apart by its
``run_episode`` method.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from rlcore.interfaces.environment import Message

if TYPE_CHECKING:
    import openai


@dataclass(frozen=True)
class OpenAIEndpoint:
    """Where an episode's agent reaches the policy: an OpenAI-compatible ``base_url`` (ending in ``/v1``).

    The rollout id is part of ``base_url`` (``.../rollouts/<rollout_id>/v1``), so any OpenAI client keeps it
    without custom headers. ``model`` is the name the server answers to; the key is not checked (loopback only).
    """

    base_url: str
    model: str
    api_key: str = "rlcore"

    def async_client(self) -> openai.AsyncOpenAI:
        """An ``openai.AsyncOpenAI`` client for this endpoint (the ``openai`` package is imported here)."""
        import openai

        return openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key)


@dataclass
class AgentSample:
    """One dataset sample as an agent sees it: the prompt's messages, the row's metadata (the expected answer under
    ``"ground_truth"``) and the tools the environment declares (OpenAI function-tool schemas), or ``None``."""

    messages: list[Message]
    metadata: dict[str, Any]
    tools: list[dict[str, Any]] | None = None


@dataclass
class AgentOutcome:
    """What an episode earned. ``reward_components``: named rewards (summed by convention into ``reward``), as in
    ``EnvironmentReturn``. ``error``: why the episode could not be scored (the sample gets reward 0 and is counted
    in ``env/errors``)."""

    reward: float
    reward_components: dict[str, float] | None = None
    error: str | None = None


@runtime_checkable
class AgentEnvironment(Protocol):
    """Runs one episode of an agent against the policy's endpoint and scores it."""

    async def run_episode(self, endpoint: OpenAIEndpoint, sample: AgentSample) -> AgentOutcome:
        """Chat with the policy at ``endpoint`` about ``sample``; return the episode's reward."""
        ...


def is_agent_environment(environment: object) -> bool:
    """Whether ``environment`` (an object or a class) is an agent environment (it has a ``run_episode`` method)."""
    return callable(getattr(environment, "run_episode", None))


def agent_of(environment: object) -> AgentEnvironment | None:
    """The agent environment behind ``environment``: itself, or the one a runner holds in its ``agent_environment``
    (:class:`rlcore.environments.runner.EnvironmentRunner`); None for an environment that is stepped."""
    held = getattr(environment, "agent_environment", None)
    agent = held if held is not None else environment
    return agent if isinstance(agent, AgentEnvironment) else None


__all__ = ["AgentEnvironment", "AgentOutcome", "AgentSample", "OpenAIEndpoint", "agent_of", "is_agent_environment"]
