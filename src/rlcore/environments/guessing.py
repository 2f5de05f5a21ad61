"""A multi-turn toy: guess a hidden digit, told "higher" or "lower" after each wrong guess.

The guess is the completion's first non-space character (a digit, else no
guess). A guess ``g`` of the secret ``s`` is worth its closeness
``1 - |g - s| / 9`` (0 without a guess); each turn's reward is the change in
closeness since the previous turn, so an episode's summed reward is the
closeness of its last guess however many turns it ran, and a right guess
(closeness 1) ends it. A wrong guess gets the observation ``" higher:"`` or
``" lower:"``, no guess ``" a digit:"``.

Why this task: a randomly initialised byte-level model must first learn to
answer with a digit (the single-turn digits task in miniature), and then
gains by reading the feedback of earlier turns, which only a multi-turn
rollout gives it. It needs no data file (:func:`guessing_games` makes the
episodes) and moves within a few dozen CPU steps.
"""

from __future__ import annotations

import random
from typing import Any

from rlcore.environments.scoring import ground_truth, last_completion
from rlcore.interfaces.environment import EnvironmentReturn, Message


def guessing_games(step: int, n: int, seed: int = 0) -> list[dict[str, str]]:
    """``n`` episodes for training step ``step``: the prompt and the secret digit (the sample's answer)."""
    rng = random.Random(seed * 1_000_003 + step)
    return [{"input": "guess a digit:", "output": str(rng.randrange(10))} for _ in range(n)]


def closeness(guess: str, secret: int) -> float:
    return 1.0 - abs(int(guess) - secret) / 9.0 if guess.isdigit() else 0.0


class GuessingEnvironment:
    """The guessing game as an environment; the secret is each sample's ``ground_truth``."""

    def __init__(self, config: Any = None) -> None:
        del config

    def step(self, message_logs: list[list[Message]], metadata: list[dict[str, Any]]) -> EnvironmentReturn:
        observations, next_metadata, rewards, done, answers = [], [], [], [], []
        for log, meta in zip(message_logs, metadata):
            secret = int(ground_truth(meta))
            guess = last_completion(log).lstrip()[:1]
            now = closeness(guess, secret)
            rewards.append(now - float(meta.get("closeness", 0.0)))
            right = guess.isdigit() and int(guess) == secret
            done.append(right)
            answers.append(guess if guess.isdigit() else None)
            hint = (
                ""
                if right
                else " a digit:"
                if not guess.isdigit()
                else " higher:"
                if int(guess) < secret
                else " lower:"
            )
            observations.append({"role": "environment", "content": hint})
            next_metadata.append(None if right else {**meta, "closeness": now})
        return EnvironmentReturn(observations, next_metadata, rewards, done, answers=answers)
