"""Rollouts of an agent environment: each episode is an agent program talking to the policy over the run's
OpenAI-compatible endpoint (docs/agents.md).

The endpoint (:mod:`rlcore.serving`) is served on the loopback for the length of the rollout, over a generation
backend that serves requests continuously. Every sample copy gets a rollout id of its own and the base URL that
carries it; the episodes run concurrently (asyncio, one event loop on a thread of the driver), each awaiting
``environment.run_episode(endpoint, sample)``. The server records each episode's turns as token ids (the engine's
prompt and generated ids, logprobs, weight versions), so the rollout is built from what was sampled, never from
re-rendered text: the same data keys as :func:`rlcore.run.rollouts.run_rollout`'s, the generated tokens of every
turn trained (``token_mask``), the tokens the chat template appended between turns (tool results, user messages)
masked out as context, and ``invalid_tool_call_mask`` on the generated tokens of a turn whose tool calls were
malformed.

The reward is the episode's :class:`rlcore.interfaces.agent.AgentOutcome`. An episode that raises, returns an error,
returns something else, or breaks its token sequence (a rewritten history, rlcore.serving.episodes) gets reward 0
and is counted in ``env/errors``, as a sample an environment cannot score. ``data.max_input_seq_length`` cannot cut
a prompt the agent writes: an episode whose first prompt is that long is served as is and marked ``prompt_cut`` (it
trains nothing), as the other path's cut prompts are.
"""

from __future__ import annotations

import inspect
import math
import threading
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rlcore.run.rollouts import Rollout, TrajectoryTensors, padded_trajectories

if TYPE_CHECKING:
    from rlcore.datasets import Sample
    from rlcore.interfaces.agent import AgentOutcome, AgentSample, OpenAIEndpoint
    from rlcore.run.step import Timer
    from rlcore.serving.episodes import Episode


def run_agent_rollout(
    cfg: Any,
    generation: Any,
    environment: Any,
    tokenizer: Any,
    samples: list[Sample],
    repeat: int,
    timer: Timer,
    *,
    greedy: bool = False,
) -> Rollout:
    """Roll out ``samples`` (each ``repeat`` times) as agent episodes of ``environment`` (an
    :class:`rlcore.interfaces.agent.AgentEnvironment`) against ``generation``; ``greedy``: decode greedily."""
    import torch

    from rlcore.interfaces.agent import AgentSample, OpenAIEndpoint
    from rlcore.interfaces.generation import serves_continuously
    from rlcore.run.prompts import pad_id
    from rlcore.run.rollouts import _ROLLOUT_STEP
    from rlcore.run.step import loop_setting, max_input_of
    from rlcore.serving.checks import NOT_CONTINUOUS
    from rlcore.serving.server import PolicyServer
    from rlcore.serving.service import ChatService, ServingSettings

    if not serves_continuously(generation):
        raise ValueError(NOT_CONTINUOUS.format(backend=cfg.policy.generation.backend, what="an agent environment"))
    if not inspect.iscoroutinefunction(environment.run_episode):
        raise TypeError(
            f"{type(environment).__name__}.run_episode is not an async function; an agent environment defines "
            "async def run_episode(self, endpoint, sample) -> AgentOutcome (rlcore.interfaces.agent)"
        )
    settings = ServingSettings.from_config(cfg, pad_id(tokenizer))
    service = ChatService(generation, tokenizer, settings)
    run_seed, step = loop_setting(cfg, "seed", 0) or 0, _ROLLOUT_STEP.get()
    tools = getattr(environment, "tools", None)
    batch = uuid.uuid4().hex[:12]
    ids = [f"{batch}-{i}" for i in range(len(samples) * repeat)]
    agent_samples: list[AgentSample] = []
    for i, rollout_id in enumerate(ids):
        row, copy = samples[i // repeat].idx, i % repeat
        service.episodes.open(rollout_id, _seeds(run_seed, step, row, copy), greedy)
        sample = samples[i // repeat]
        agent_samples.append(AgentSample([dict(m) for m in sample.messages], dict(sample.metadata), tools))
    with timer.phase("generation"), PolicyServer(service) as server:
        endpoints = [OpenAIEndpoint(server.url_for(r), settings.sampling.model) for r in ids]
        outcomes = run_episodes(environment, endpoints, agent_samples, _episode_timeout(cfg))
    episodes = [service.episodes.close(r) for r in ids]
    rewards, errors, result = _scored(outcomes, episodes, agent_samples)
    data = _trajectories(cfg, tokenizer, episodes, agent_samples, settings.pad_id)
    metrics = _metrics(episodes, errors, data, samples, repeat)
    if max_input_of(cfg) is not None:  # the prompts (not their copies) at data.max_input_seq_length or longer
        metrics["cut_prompts"] = float(data["prompt_cut"].sum()) / repeat
    for name in sorted(result.reward_components or {}):
        data[f"reward/{name}"] = torch.tensor(result.reward_components[name], dtype=torch.float32)
    return Rollout(data, torch.tensor(rewards, dtype=torch.float32), metrics)


def _seeds(run_seed: int, step: int | None, row: int, copy: int) -> Callable[[int], int]:
    """``turn -> seed`` of one episode's requests: the seeds :func:`rlcore.run.rollouts.sampling_seed` gives the
    turns of the other path (the same run, step, data row and copy)."""
    from rlcore.run.rollouts import sampling_seed

    return lambda turn: sampling_seed(run_seed, step, row, copy, turn)


class EpisodeTimedOut(Exception):
    """An agent episode ran past ``env.timeout_s``: its sample fails (reward 0, counted in ``env/errors``)."""


def _episode_timeout(cfg: Any) -> float | None:
    """``env.timeout_s``: how long one agent episode may take (None for a stand-in config without it)."""
    return getattr(getattr(cfg, "env", None), "timeout_s", None)


def run_episodes(
    environment: Any,
    endpoints: list[OpenAIEndpoint],
    samples: list[AgentSample],
    timeout_s: float | None = None,
) -> list[AgentOutcome | BaseException]:
    """Each sample's ``run_episode`` (or what it raised), run concurrently on one event loop of a thread of its own
    (so that a caller already inside an event loop can call this). An episode still running after ``timeout_s`` is
    cancelled and gives :class:`EpisodeTimedOut`, so an agent that never returns costs its sample, not the run (one
    that blocks the event loop without awaiting cannot be cancelled: agents await their I/O)."""
    import asyncio

    results: list[Any] = []
    failure: list[BaseException] = []

    async def episode(endpoint: OpenAIEndpoint, sample: AgentSample) -> Any:
        try:
            return await asyncio.wait_for(environment.run_episode(endpoint, sample), timeout_s)
        except asyncio.TimeoutError:
            raise EpisodeTimedOut(f"the episode took longer than env.timeout_s ({timeout_s:g} s)") from None

    async def all_episodes() -> list[Any]:
        return await asyncio.gather(*(episode(e, s) for e, s in zip(endpoints, samples)), return_exceptions=True)

    def main() -> None:
        try:
            results.extend(asyncio.run(all_episodes()))
        except BaseException as exc:  # handed to the caller's thread
            failure.append(exc)

    thread = threading.Thread(target=main, name="rlcore-agent-episodes")
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return results


def _scored(
    outcomes: list[Any], episodes: list[Episode], samples: list[AgentSample]
) -> tuple[list[float], list[str | None], Any]:
    """Each episode's reward and error (reward 0 with an error), and their named components as one
    ``EnvironmentReturn`` (which checks that every scored sample names the same ones)."""
    from rlcore.environments.scoring import NONFINITE_REWARD
    from rlcore.interfaces.agent import AgentOutcome
    from rlcore.interfaces.environment import EnvironmentReturn

    parts = []
    for outcome, episode, sample in zip(outcomes, episodes, samples):
        reward, error, components = 0.0, None, None
        if episode.error is not None:  # the episode broke its token sequence (or the engine failed)
            error = episode.error
        elif isinstance(outcome, BaseException):
            error = f"the agent raised {type(outcome).__name__}: {outcome}"
        elif not isinstance(outcome, AgentOutcome):
            error = f"run_episode returned {type(outcome).__name__}, not an AgentOutcome"
        elif outcome.error is not None:
            error = outcome.error
        elif not math.isfinite(float(outcome.reward)):
            error = f"{NONFINITE_REWARD} {outcome.reward!r} from the agent environment"
        else:
            reward = float(outcome.reward)
            components = (
                {k: [float(v)] for k, v in outcome.reward_components.items()} if outcome.reward_components else None
            )
        parts.append(EnvironmentReturn.final([reward], [sample.metadata], errors=[error], reward_components=components))
    result = EnvironmentReturn.concat(parts)
    return result.rewards, result.errors, result


def _trajectories(cfg: Any, tokenizer: Any, episodes: list[Episode], samples: list[AgentSample], pad: int) -> Any:
    """The episodes' token sequences as one right-padded batch with ``run_rollout``'s keys."""
    import torch
    from torch.nn.utils.rnn import pad_sequence

    from rlcore.data import BatchedDataDict
    from rlcore.run.step import max_input_of

    tokens, masks, logprobs, versions, invalid = [], [], [], [], []
    prompt_lengths, first_turn, truncated, cut = [], [], [], []
    max_input = max_input_of(cfg)
    for episode, sample in zip(episodes, samples):
        seq = _sequence(cfg, tokenizer, episode, sample)
        n = len(seq)
        mask, lps = torch.zeros(n), torch.zeros(n)
        token_versions, bad = torch.full((n,), -1, dtype=torch.long), torch.zeros(n, dtype=torch.bool)
        for turn in episode.turns:
            start, count = len(turn.prompt_ids), len(turn.generated_ids)
            mask[start : start + count] = 1
            lps[start : start + count] = torch.tensor(turn.logprobs, dtype=torch.float32)
            if turn.token_versions is not None:
                token_versions[start : start + count] = torch.tensor(turn.token_versions, dtype=torch.long)
            bad[start : start + count] = turn.invalid_tool_calls
        tokens.append(torch.tensor(seq, dtype=torch.long))
        masks.append(mask)
        logprobs.append(lps)
        versions.append(token_versions)
        invalid.append(bad)
        first = len(episode.turns[0].prompt_ids) if episode.turns else n
        prompt_lengths.append(first)
        first_turn.append(len(episode.turns[0].generated_ids) if episode.turns else 0)
        truncated.append(episode.out_of_room or any(t.truncated for t in episode.turns))
        cut.append(max_input is not None and first >= max_input)
    lengths = torch.tensor(prompt_lengths, dtype=torch.long)
    tensors = TrajectoryTensors(
        tokens, masks, logprobs, invalid, lengths, first_turn, truncated, torch.tensor(cut, dtype=torch.bool)
    )
    data: BatchedDataDict[Any] = padded_trajectories(tensors, pad)
    turns = [t for e in episodes for t in e.turns]
    if turns and all(t.weight_version is not None for t in turns):
        oldest = min(int(t.weight_version) for t in turns)  # type: ignore[arg-type]
        data["weight_version"] = torch.tensor(
            [min((int(t.weight_version) for t in e.turns), default=oldest) for e in episodes],  # type: ignore[arg-type]
            dtype=torch.long,
        )
    if turns and all(t.window is not None for t in turns):
        span = (min(t.window[0] for t in turns), max(t.window[1] for t in turns))  # type: ignore[index]
        data["generation_window"] = torch.tensor(
            [
                [min(t.window[0] for t in e.turns), max(t.window[1] for t in e.turns)] if e.turns else list(span)  # type: ignore[index]
                for e in episodes
            ],
            dtype=torch.float64,
        )
    if any(t.token_versions is not None for t in turns):
        data["generation_weight_versions"] = pad_sequence(versions, batch_first=True, padding_value=-1)
    return data


def _sequence(cfg: Any, tokenizer: Any, episode: Episode, sample: AgentSample) -> list[int]:
    """The episode's token sequence: its last turn's prompt and completion; without a turn, the sample's prompt
    under the chat template (context only: nothing of it is trained)."""
    if episode.turns:
        return episode.turns[-1].sequence
    from rlcore.chat import templates

    kwargs = cfg.policy.tokenizer.chat_template_kwargs
    return list(templates.prompt_ids(tokenizer, sample.messages, tools=sample.tools, chat_template_kwargs=kwargs))


def _metrics(
    episodes: list[Episode], errors: list[str | None], data: Any, samples: list[Sample], repeat: int
) -> dict[str, float | str]:
    from rlcore.run.rollouts import error_metrics

    failed = [(f"data row {samples[i // repeat].idx}: {e}", e) for i, e in enumerate(errors) if e]
    n = len(episodes)
    metrics: dict[str, float | str] = {
        **error_metrics(failed),
        "rollout/turns_mean": sum(len(e.turns) for e in episodes) / n,
        "rollout/tool_calls_mean": sum(t.tool_calls for e in episodes for t in e.turns) / n,
        "rollout/truncation_rate": float(data["truncated"].float().mean()),
        "rollout/env_tokens_mean": float(
            (data["unpadded_sequence_lengths"] - data["input_lengths"] - data["generation_lengths"]).float().mean()
        ),
    }
    if "weight_version" in data:
        metrics["weight_version"] = float(data["weight_version"].min())
    return metrics
