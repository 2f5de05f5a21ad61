"""Environments that compare text: ``exact_match`` and ``regex``."""

from __future__ import annotations

import re
from typing import Any

from pydantic import Field, field_validator

from rlcore.config.base import StrictModel
from rlcore.environments.scoring import ground_truth, score_each
from rlcore.interfaces.environment import EnvironmentReturn, Message


class ExactMatchConfig(StrictModel):
    strip: bool = Field(True, description="Ignore leading and trailing whitespace on both sides.")
    case_sensitive: bool = Field(True, description="Whether 'Paris' and 'paris' differ.")


class ExactMatchEnvironment:
    """1 when the completion is the ground truth, else 0."""

    def __init__(self, config: ExactMatchConfig | None = None) -> None:
        self.config = config or ExactMatchConfig()

    def _norm(self, text: str) -> str:
        text = text.strip() if self.config.strip else text
        return text if self.config.case_sensitive else text.casefold()

    def step(self, message_logs: list[list[Message]], metadata: list[dict[str, Any]]) -> EnvironmentReturn:
        def score(completion: str, meta: dict[str, Any]) -> tuple[float, str]:
            return float(self._norm(completion) == self._norm(ground_truth(meta))), completion

        return score_each(score, message_logs, metadata)


class RegexConfig(StrictModel):
    pattern: str = Field(description="A Python regular expression searched in the completion.")
    compare: bool = Field(
        True,
        description="true: the last match's first group (or the whole match) must equal "
        "ground_truth; false: any match scores 1.",
    )

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, v: str) -> str:
        try:
            re.compile(v)
        except re.error as exc:
            raise ValueError(f"not a regular expression: {exc}") from None
        return v


class RegexEnvironment:
    """The answer is what a pattern finds in the completion."""

    def __init__(self, config: RegexConfig) -> None:
        self.config = config
        self.pattern = re.compile(config.pattern)

    def step(self, message_logs: list[list[Message]], metadata: list[dict[str, Any]]) -> EnvironmentReturn:
        def score(completion: str, meta: dict[str, Any]) -> tuple[float, str | None]:
            matches = list(self.pattern.finditer(completion))
            if not matches:
                return 0.0, None
            last = matches[-1]
            answer = last.group(1) if last.groups() else last.group(0)
            if not self.config.compare:
                return 1.0, answer
            return float(answer.strip() == ground_truth(meta).strip()), answer

        return score_each(score, message_logs, metadata)
