"""Scoring one sample at a time: what every single-turn built-in environment shares."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlcore.interfaces.environment import EnvironmentReturn, Message


def last_completion(log: list[Message]) -> str:
    """The content of the log's last assistant message ('' when there is none)."""
    for message in reversed(log):
        if message.get("role") == "assistant":
            return message.get("content", "")
    return ""


def last_prompt(log: list[Message]) -> str:
    """The content of the log's last user message ('' when there is none)."""
    for message in reversed(log):
        if message.get("role") == "user":
            return message.get("content", "")
    return ""


def score_each(
    score: Callable[[str, dict[str, Any]], tuple[float, str | None]],
    message_logs: list[list[Message]],
    metadata: list[dict[str, Any]],
) -> EnvironmentReturn:
    """Score every log's last completion with ``score(completion, metadata) -> (reward, answer)``; a sample whose
    scoring raises gets reward 0 and its error."""
    rewards, answers, errors = [], [], []
    for log, meta in zip(message_logs, metadata):
        try:
            reward, answer = score(last_completion(log), meta)
            rewards.append(float(reward))
            answers.append(answer)
            errors.append(None)
        except Exception as exc:  # noqa: BLE001 - one sample's failure is that sample's zero
            rewards.append(0.0)
            answers.append(None)
            errors.append(f"{type(exc).__name__}: {exc}")
    return EnvironmentReturn.final(rewards, metadata, answers, errors)


def ground_truth(meta: dict[str, Any]) -> str:
    """The sample's expected answer as text; a sample without one cannot be scored by comparison."""
    truth = meta.get("ground_truth")
    if truth is None:
        raise ValueError("the sample has no ground_truth (set data.output_key to the column holding the answer)")
    return str(truth)


#: How a non-finite reward's error line begins (rollouts count these apart: ``env/nonfinite_rewards``).
NONFINITE_REWARD = "non-finite reward"


def nonfinite_samples(result: EnvironmentReturn) -> list[tuple[int, str]]:
    """``(index, what)`` of each sample whose reward, or one of its reward components, is NaN or +-inf."""
    import math

    found = []
    for i, reward in enumerate(result.rewards):
        parts = [
            f"{name}={values[i]!r}"
            for name, values in (result.reward_components or {}).items()
            if not math.isfinite(values[i])
        ]
        if not math.isfinite(reward):
            found.append((i, f"{reward!r}" + (f" ({', '.join(parts)})" if parts else "")))
        elif parts:
            found.append((i, ", ".join(parts)))
    return found


def zero_nonfinite(result: EnvironmentReturn, found: list[tuple[int, str]], env_name: str) -> EnvironmentReturn:
    """``result`` with each of the ``found`` samples failed: reward 0 (and each component 0) and an error line
    saying what the environment returned. Training on a NaN reward would make every weight NaN."""
    for i, what in found:
        result.rewards[i] = 0.0
        for values in (result.reward_components or {}).values():
            values[i] = 0.0
        result.errors[i] = f"{NONFINITE_REWARD} {what} from environment '{env_name}'"
    return result
