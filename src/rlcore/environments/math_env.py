"""The ``math`` environment: the completion's final answer against the sample's ``ground_truth``, as math."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from rlcore.config.base import StrictModel
from rlcore.environments.scoring import ground_truth, score_each
from rlcore.interfaces.environment import EnvironmentReturn, Message


class MathConfig(StrictModel):
    verifier: Literal["auto", "math_verify", "builtin", "dapo"] = Field(
        "auto",
        description="math_verify: Hugging Face's math-verify (pip install 'rlcore[math]'); builtin: "
        "rlcore's own rules (boxed answers, numbers, fractions, simple symbolic forms with sympy); dapo: DAPO's "
        "grader (NeMo-RL's dapo_math_verify: the last 'Answer:' line, Minerva-normalised, equal as a string); "
        "auto: math_verify when installed.",
    )


class MathEnvironment:
    """1 when the completion's answer (its last ``\\boxed{}``, else its last number) equals the ground truth."""

    def __init__(self, config: MathConfig | None = None) -> None:
        from rlcore.environments import math_grading

        self.config = config or MathConfig()
        self._grading = math_grading
        if self.config.verifier == "math_verify" and math_grading.grader_name() != "math_verify":
            raise RuntimeError(
                "env.math_cfg.verifier: math_verify is not installed: pip install 'rlcore[math]' "
                "or set verifier: builtin"
            )

    def step(self, message_logs: list[list[Message]], metadata: list[dict[str, Any]]) -> EnvironmentReturn:
        if self.config.verifier == "dapo":
            from rlcore.environments import dapo_grading

            return score_each(
                lambda completion, meta: dapo_grading.grade(completion, ground_truth(meta)), message_logs, metadata
            )
        builtin = self.config.verifier == "builtin"

        def score(completion: str, meta: dict[str, Any]) -> tuple[float, str | None]:
            truth = ground_truth(meta)
            return self._grading.grade(completion, truth, builtin=builtin), self._grading.extract_answer(completion)

        return score_each(score, message_logs, metadata)
