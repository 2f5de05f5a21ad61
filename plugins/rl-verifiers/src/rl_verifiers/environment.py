"""``VerifiersEnvironment``: a verifiers (0.4, ``verifiers.v1``) environment as an rlcore agent environment.

For each sample the adapter builds a task of the environment's task type (the sample's messages as its prompt,
its metadata in the task data's fields), runs one verifiers episode against rlcore's endpoint (the run's model,
every turn through the endpoint, which records the exact token ids) and scores it with the task's rubric: the
reward is the sum of the trainable traces' weighted rewards, each reward function a component (GDPO reads them).
A failed episode (verifiers' own error, a harness or tool failure, a reward that did not run) is
``AgentOutcome(0.0, error=...)``.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rl_verifiers.config import VerifiersConfig
from rl_verifiers.loading import SECTION
from rlcore.interfaces.agent import AgentOutcome, AgentSample, OpenAIEndpoint

if TYPE_CHECKING:
    import verifiers.v1 as vf

#: The environment variable verifiers reads the endpoint's key from (rlcore's endpoint checks none).
API_KEY_VAR = "RLCORE_VERIFIERS_API_KEY"


class VerifiersEnvironment:
    """Runs each sample as one episode of the configured verifiers environment (imports verifiers when built)."""

    tools: list[dict[str, Any]] | None = None  # a verifiers task's tools reach the model through its harness

    def __init__(self, config: VerifiersConfig | None) -> None:
        from rl_verifiers.loading import env_factory, task_data_fields

        if config is None:
            raise ValueError(f"{SECTION}: the verifiers environment needs its section (environment: <taskset id>)")
        self.config = config
        self._build: Callable[[], vf.Env] = env_factory(config)
        self._fields = task_data_fields(self._build())
        field = config.ground_truth_field
        if field is not None and field not in self._fields:
            raise ValueError(
                f"{SECTION}.ground_truth_field: {field!r} is not a field of the task data "
                f"({', '.join(sorted(self._fields))}); name the one the rubric compares with, or null"
            )
        self._gates: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary()
        )

    async def run_episode(self, endpoint: OpenAIEndpoint, sample: AgentSample) -> AgentOutcome:
        """One verifiers episode about ``sample`` against ``endpoint``, scored by the task's rubric."""
        async with self._gate():
            try:
                episode = await self._play(endpoint, sample)
            except Exception as exc:  # noqa: BLE001 - a verifiers failure is the episode's error, not the run's
                return AgentOutcome(0.0, error=f"{type(exc).__name__}: {exc}")
        return outcome(episode)

    async def _play(self, endpoint: OpenAIEndpoint, sample: AgentSample) -> vf.Episode:
        import verifiers.v1 as vf

        from rl_verifiers.stream_bridge import stream_bridge

        env = self._build()  # an Env per episode: its serving resources belong to one event loop and one episode
        task = self._task(env, sample)
        sampling = (
            vf.SamplingConfig(max_tokens=self.config.max_tokens) if self.config.max_tokens else vf.SamplingConfig()
        )
        async with stream_bridge(endpoint.base_url) as url, env.serving():
            client = vf.EvalClientConfig(base_url=url, api_key_var=API_KEY_VAR)
            return await env.run_episode(task, vf.ModelContext(model=endpoint.model, client=client, sampling=sampling))

    def _task(self, env: vf.Env, sample: AgentSample) -> vf.Task:
        """The sample as a task of ``env``'s task type: its messages the prompt, its metadata the data's fields."""
        task_type = type(env.taskset).task_type()
        data: dict[str, Any] = {k: v for k, v in sample.metadata.items() if k in self._fields and k != "prompt"}
        field = self.config.ground_truth_field
        if field is not None and "ground_truth" in sample.metadata:
            data[field] = sample.metadata["ground_truth"]
        data["prompt"] = [dict(m) for m in sample.messages]
        if env.taskset.system_prompt is not None:  # verifiers' taskset-level system prompt override
            data["system_prompt"] = env.taskset.system_prompt
        return task_type(task_type.data_type().model_validate(data), env.taskset.config.task)

    def _gate(self) -> asyncio.Semaphore:
        """This event loop's bound on concurrent episodes (``max_concurrent_episodes``; unbounded without one)."""
        loop = asyncio.get_running_loop()
        if loop not in self._gates:
            self._gates[loop] = asyncio.Semaphore(self.config.max_concurrent_episodes or 1_000_000)
        return self._gates[loop]


def outcome(episode: vf.Episode) -> AgentOutcome:
    """A finished verifiers episode as rlcore's outcome: the trainable traces' weighted rewards, summed."""
    if not episode.ok or not all(t.ok for t in episode.traces):  # errors also keep the retried attempts' ones
        errors = [*episode.errors, *(e for t in episode.traces if not t.ok for e in t.errors)]
        error = errors[-1] if errors else None
        why = f"{error.type}: {error.message}" if error else "the episode did not finish"
        return AgentOutcome(0.0, error=f"verifiers episode failed: {why}")
    traces = [t for t in episode.traces if t.agent.trainable]
    components: dict[str, float] = {}
    for trace in traces:
        for name, reward in trace.rewards.items():
            key = name if len(traces) == 1 else f"{trace.agent.name}.{name}"
            if reward is None:
                return AgentOutcome(0.0, error=f"verifiers episode failed: reward {key!r} was not scored")
            components[key] = components.get(key, 0.0) + reward.value
    total = sum(components.values())
    return AgentOutcome(total, reward_components=components if len(components) > 1 else None)
