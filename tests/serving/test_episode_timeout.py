"""An agent episode that never returns costs its own sample after ``env.timeout_s``, not the run."""

from __future__ import annotations

import asyncio
import time

from rlcore.interfaces.agent import AgentOutcome, AgentSample, OpenAIEndpoint
from rlcore.run.agent_rollouts import EpisodeTimedOut, run_episodes


class HangsOnOddRows:
    """Answers at once for even rows; waits forever (awaiting, as agents wait on I/O) for odd ones."""

    async def run_episode(self, endpoint: OpenAIEndpoint, sample: AgentSample) -> AgentOutcome:
        if sample.metadata["row"] % 2:
            await asyncio.sleep(3600)
        return AgentOutcome(reward=float(sample.metadata["row"]))


def test_a_hung_episode_fails_at_the_timeout_and_the_others_keep_their_outcomes() -> None:
    samples = [AgentSample([{"role": "user", "content": "hi"}], {"row": row}) for row in range(4)]
    endpoints = [OpenAIEndpoint(f"http://127.0.0.1:1/rollouts/{row}/v1", "m") for row in range(4)]
    started = time.monotonic()
    outcomes = run_episodes(HangsOnOddRows(), endpoints, samples, timeout_s=0.5)
    assert time.monotonic() - started < 30  # bounded by the timeout, not the agent's hour
    assert [o.reward for o in outcomes if isinstance(o, AgentOutcome)] == [0.0, 2.0]
    hung = [o for o in outcomes if not isinstance(o, AgentOutcome)]
    assert [type(o) for o in hung] == [EpisodeTimedOut, EpisodeTimedOut]
    assert "env.timeout_s (0.5 s)" in str(hung[0])
    assert run_episodes(HangsOnOddRows(), endpoints[:1], samples[:1])[0] == AgentOutcome(reward=0.0)  # no timeout
