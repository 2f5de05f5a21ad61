"""The conformance kit of agent environments: what rlcore's agent rollouts rely on, checked through its endpoint.

``check_agent_environment(environment, config, cases)`` returns one line per problem ([] = conforms).
``environment`` and ``config`` are what :func:`rlcore.testing.environment_kit.check_environment` takes (a spec,
an installed name or ``"module:Class"``; the settings). Each :class:`AgentCase` is a sample a correct environment
can score, with the policy's reply to each of its requests, in order. The kit serves them from rlcore's own
OpenAI-compatible endpoint over a scripted engine (:class:`rlcore.testing.scripted_engine.ScriptedEngine`, the
tiny byte tokenizer's chat template) and rolls the cases out with
:func:`rlcore.run.agent_rollouts.run_agent_rollout`, as a run does. The core relies on these properties:

- it builds as ``Class(config)``, its config class refuses unknown keys, and ``run_episode`` is ``async``;
- every case is scored (no ``env/errors``) with a finite reward;
- the policy is reached through the endpoint only: every case makes a request, and the tokens the rollout trains
  are the scripted replies the engine gave, in order (an agent that answers for the policy trains nothing);
- an episode's reward depends on its own sample and replies only: the same when the batch is rolled out again
  and when the case is rolled out alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class AgentCase:
    """One sample: its prompt ``messages``, its ``metadata`` (``ground_truth``, ...) and the policy's ``replies``,
    one per request the agent makes."""

    messages: list[dict[str, Any]]
    metadata: dict[str, Any] = field(default_factory=dict)
    replies: list[str] = field(default_factory=list)


def check_agent_environment(environment: Any, config: Any, cases: list[AgentCase]) -> list[str]:
    """Problems of ``environment`` built with ``config``, on ``cases`` (at least two)."""
    import inspect

    from rlcore.environments.runner import build_environment
    from rlcore.interfaces.agent import AgentEnvironment
    from rlcore.testing.environment_kit import _class_and_config

    if len(cases) < 2:
        return ["check_agent_environment needs at least two cases"]
    try:
        env_class, config = _class_and_config(environment, config)
        env = build_environment(env_class, config)
    except Exception as exc:  # noqa: BLE001 - an unusable spec, config or constructor is the problem
        return [f"{environment!r}: {type(exc).__name__}: {' '.join(str(exc).split())}"]
    if not isinstance(env, AgentEnvironment) or not inspect.iscoroutinefunction(env.run_episode):
        return [f"{env_class} is not an agent environment: it needs async def run_episode(self, endpoint, sample)"]
    problems: list[str] = []
    try:
        whole = _rollout(env, cases, problems)
        if _rollout(env, cases, []) != whole:
            problems.append("rolling out the same cases again gave different rewards")
        alone = [_rollout(env, [case], [])[0] for case in cases]
        if alone != whole:
            problems.append(f"rewards of cases rolled out one by one {alone} differ from the batch's {whole}")
    except Exception as exc:  # noqa: BLE001 - the contract's failures, one line each
        problems.append(f"the rollout raised {type(exc).__name__}: {' '.join(str(exc).split())}")
    return problems


def _rollout(env: Any, cases: list[AgentCase], problems: list[str]) -> list[float]:
    """The cases' rewards from one agent rollout; what breaks the contract is added to ``problems``."""
    import math

    from rlcore.datasets import Sample
    from rlcore.models.tokenizer import build_tiny_tokenizer
    from rlcore.run.agent_rollouts import run_agent_rollout
    from rlcore.run.step import Timer
    from rlcore.testing.scripted_engine import ScriptedEngine

    tokenizer = build_tiny_tokenizer()
    markers = [f"[kit case {i}]" for i in range(len(cases))]
    engine = ScriptedEngine(tokenizer, {m: list(c.replies) for m, c in zip(markers, cases)}, max_new_tokens=256)
    samples = [
        Sample(i, _marked(case.messages, marker), dict(case.metadata))
        for i, (marker, case) in enumerate(zip(markers, cases))
    ]
    rollout = run_agent_rollout(_kit_config(), engine, env, tokenizer, samples, 1, Timer())
    if rollout.metrics.get("env/errors"):
        problems.append(f"a case was not scored: {rollout.metrics.get('env/first_error')}")
    rewards = [float(r) for r in rollout.rewards]
    if not all(math.isfinite(r) for r in rewards):
        problems.append(f"rewards must be finite numbers, got {rewards}")
    for i, case in enumerate(cases):
        mask = rollout.data["token_mask"][i].bool()
        trained = tokenizer.decode(rollout.data["output_ids"][i][mask].tolist(), skip_special_tokens=True)
        served = sum(markers[i] in tokenizer.decode(r["prompt"]) for r in engine.requests)
        if served == 0:
            problems.append(f"case {i}: the agent made no request to the endpoint")
        elif trained != "".join(case.replies[:served]):
            problems.append(f"case {i}: the trained tokens {trained!r} are not the replies the endpoint served")
    return rewards


def _marked(messages: list[dict[str, Any]], marker: str) -> list[dict[str, Any]]:
    """``messages`` with ``marker`` (which tells the scripted engine whose request it is) before the first one's
    content."""
    first, *rest = [dict(m) for m in messages]
    first["content"] = f"{marker} {first.get('content', '')}"
    return [first, *rest]


def _kit_config() -> Any:
    from rlcore.config import load_config_dict

    return load_config_dict(
        {
            "policy": {
                "backend": "reference",
                "model_name": "tiny-llama",
                "max_total_sequence_length": 2048,
                "generation": {"backend": "vllm", "max_new_tokens": 256},
            },
            "env": {"timeout_s": 120},
        }
    )


__all__ = ["AgentCase", "check_agent_environment"]
