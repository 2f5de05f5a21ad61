"""The ``vlm`` environment: a weighted sum of answer checks, as NeMo-RL's VLM environment scores its image tasks.

NeMo-RL's ``env.<name>.reward_functions`` (``nemo_rl/environments/rewards.py``, read at main 7ea279a), each a
function of the completion (its assistant messages, joined) and the ground truth:

- ``format``: 0.25 when the completion holds a ``<think>...</think>`` pair, plus 0.75 for an
  ``<answer>...</answer>`` pair (tags: ``think_tag``, ``answer_tag``);
- ``exact_alnum``: 1 when the answer (from the first ``<answer>`` to the last ``</answer>``) equals the ground
  truth after both keep only their letters and digits, lowercased;
- ``math_expr``: 1 when that answer is the ground truth as math (each read as ``\\boxed{...}``;
  :mod:`rlcore.environments.math_grading`);
- ``bbox_giou``: the IoU of the answer's ``[x1, y1, x2, y2]`` box with the ground truth's, or their generalized IoU
  when the IoU is under ``giou_penalty_thres`` (default 10: always);
- ``geo3k``: ``(1 - format_score)`` for a last ``\\boxed{}`` that is the ground truth as math, plus
  ``format_score`` when a ``\\boxed{}`` follows ``</think>``.

The weights are divided by their sum, and each function's weighted reward is a named reward component; the
reward is their sum. A ground truth inside ``<answer>`` tags (CLEVR-CoGenT's ``solution`` column) is read as what
the tags hold, as NeMo-RL's CLEVR loader reads it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, Literal

from pydantic import Field, field_validator

from rlcore.config.base import StrictModel
from rlcore.interfaces.environment import EnvironmentReturn, Message

#: Each function's keyword arguments and their defaults (NeMo-RL's).
KWARGS: dict[str, dict[str, Any]] = {
    "format": {"think_tag": "think", "answer_tag": "answer"},
    "exact_alnum": {"answer_tag": "answer"},
    "math_expr": {"tag": "answer"},
    "bbox_giou": {"giou_penalty_thres": 10.0, "answer_tag": "answer"},
    "geo3k": {"format_score": 0.1},
}
Name = Literal["format", "exact_alnum", "math_expr", "bbox_giou", "geo3k"]


class RewardFunction(StrictModel):
    name: Name = Field(description="Which check: format, exact_alnum, math_expr, bbox_giou or geo3k.")
    weight: float = Field(description="Its weight; the weights are divided by their sum.")
    kwargs: dict[str, Any] | None = Field(
        None,
        description="Its options: format: think_tag, answer_tag; exact_alnum: answer_tag; math_expr: tag; "
        "bbox_giou: giou_penalty_thres, answer_tag; geo3k: format_score.",
    )

    @field_validator("kwargs")
    @classmethod
    def _known(cls, kwargs: dict[str, Any] | None, info: Any) -> dict[str, Any] | None:
        name = info.data.get("name")
        if kwargs and name in KWARGS and (unknown := sorted(set(kwargs) - set(KWARGS[name]))):
            raise ValueError(f"{unknown}: {name} takes {', '.join(KWARGS[name])}")
        return kwargs


class VlmRewardsConfig(StrictModel):
    reward_functions: list[RewardFunction] = Field(
        min_length=1,
        description="The checks and their weights (NeMo-RL's env.<name>.reward_functions), each a named "
        "reward component: its weight over the sum of the weights, times its reward.",
    )

    @field_validator("reward_functions")
    @classmethod
    def _weights(cls, functions: list[RewardFunction]) -> list[RewardFunction]:
        names = [f.name for f in functions]
        if len(set(names)) < len(names):
            raise ValueError(f"{names}: list each function once (its weight is its share)")
        if sum(f.weight for f in functions) == 0:
            raise ValueError("the weights sum to 0; give them a positive sum")
        return functions


# -- the checks ------------------------------------------------------------------------------------------------


def _tagged(response: str, tag: str) -> str | None:
    """What lies between the first ``<tag>`` and the last ``</tag>``; None without such a pair."""
    match = re.search(rf"<{re.escape(tag)}>([\s\S]*)</{re.escape(tag)}>", response)
    return match.group(1) if match else None


def format_reward(truth: str, response: str, think_tag: str = "think", answer_tag: str = "answer") -> float:
    think = _tagged(response, think_tag) is not None
    answer = _tagged(response, answer_tag) is not None
    return 0.25 * think + 0.75 * answer


def _alnum(text: str) -> str:
    return "".join(c for c in text if c.isalnum()).lower()


def exact_alnum_reward(truth: str, response: str, answer_tag: str = "answer") -> float:
    answer = _tagged(response, answer_tag)
    return float(answer is not None and _alnum(answer) == _alnum(truth))


def _boxed(text: str) -> str:
    return text if text.startswith("\\boxed{") else "\\boxed{" + text + "}"


def _same_math(answer: str, truth: str) -> float:
    from rlcore.environments.math_grading import grade

    try:
        return grade(_boxed(answer), truth)
    except Exception:  # noqa: BLE001 - an answer the grader cannot read is a wrong one, as in NeMo-RL
        return 0.0


def math_expr_reward(truth: str, response: str, tag: str = "answer") -> float:
    answer = _tagged(response, tag)
    return 0.0 if answer is None else _same_math(answer, truth)


def _box(text: str) -> tuple[float, float, float, float] | None:
    try:
        x1, y1, x2, y2 = (float(v) for v in text.replace("[", "").replace("]", "").split(","))
    except ValueError:
        return None
    return x1, y1, x2, y2


def bbox_giou_reward(truth: str, response: str, giou_penalty_thres: float = 10.0, answer_tag: str = "answer") -> float:
    answer = _tagged(response, answer_tag)
    g, r = _box(truth), (None if answer is None else _box(answer))
    if g is None or r is None:
        return 0.0
    area_g = (g[2] - g[0]) * (g[3] - g[1])
    area_r = (r[2] - r[0]) * (r[3] - r[1])
    inter = max(0.0, min(g[2], r[2]) - max(g[0], r[0])) * max(0.0, min(g[3], r[3]) - max(g[1], r[1]))
    union = max(1e-3, area_g + area_r - inter)
    iou = inter / union
    if iou >= giou_penalty_thres:
        return iou
    hull = max(1e-3, (max(g[2], r[2]) - min(g[0], r[0])) * (max(g[3], r[3]) - min(g[1], r[1])))
    return iou - (hull - union) / hull


def _last_boxed(response: str) -> str | None:
    """The content of the last ``\\boxed{`` up to its matching brace; None when there is none or it is open."""
    start = response.rfind("\\boxed{")
    if start == -1:
        return None
    depth, begin = 1, start + len("\\boxed{")
    for i in range(begin, len(response)):
        depth += {"{": 1, "}": -1}.get(response[i], 0)
        if depth == 0:
            return response[begin:i].strip()
    return None


def geo3k_reward(truth: str, response: str, format_score: float = 0.1) -> float:
    formatted = re.search(r"</think>.*\\boxed\{.*\}", response, re.DOTALL) is not None
    answer = _last_boxed(response)
    correct = answer is not None and _same_math(answer, truth) > 0.1
    return (1.0 - format_score) * correct + format_score * formatted


FUNCTIONS: dict[str, Callable[..., float]] = {
    "format": format_reward,
    "exact_alnum": exact_alnum_reward,
    "math_expr": math_expr_reward,
    "bbox_giou": bbox_giou_reward,
    "geo3k": geo3k_reward,
}


# -- the environment ----------------------------------------------------------------------------------------------


def answer_in_tags(truth: str) -> str:
    """The ground truth as NeMo-RL's CLEVR loader reads it: the text of its first ``<answer>...</answer>`` on one
    line, stripped; else all of it, stripped."""
    match = re.search(r"<answer>(.*?)</answer>", truth)
    return (match.group(1) if match else truth).strip()


def completion_text(log: list[Message]) -> str:
    """Every assistant message of the log, joined (NeMo-RL's VLM environment reads them all)."""
    return "".join(str(m.get("content", "")) for m in log if m.get("role") == "assistant")


class VlmRewardsEnvironment:
    """Scores each completion by the configured checks; each check's weighted reward is a reward component."""

    def __init__(self, config: VlmRewardsConfig) -> None:
        total = sum(f.weight for f in config.reward_functions)
        self.checks = [(f.name, f.weight / total, f.kwargs or {}) for f in config.reward_functions]

    def score(self, completion: str, meta: dict[str, Any]) -> dict[str, float]:
        truth = meta.get("ground_truth")
        if truth is None:
            raise ValueError("the sample has no ground_truth (set data.output_key to the column holding the answer)")
        truth = answer_in_tags(str(truth))
        return {name: share * FUNCTIONS[name](truth, completion, **kwargs) for name, share, kwargs in self.checks}

    def step(self, message_logs: list[list[Message]], metadata: list[dict[str, Any]]) -> EnvironmentReturn:
        components: dict[str, list[float]] = {name: [] for name, _, _ in self.checks}
        errors: list[str | None] = []
        for log, meta in zip(message_logs, metadata):
            try:
                scores, error = self.score(completion_text(log), meta), None
            except Exception as exc:  # noqa: BLE001 - one sample's failure is that sample's zero
                scores, error = dict.fromkeys(components, 0.0), f"{type(exc).__name__}: {exc}"
            for name, value in scores.items():
                components[name].append(value)
            errors.append(error)
        return EnvironmentReturn.from_components(components, metadata, errors=errors)
