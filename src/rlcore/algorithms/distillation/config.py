"""On-policy distillation's section (``distillation``): the rollout loop's settings, the teacher, and the loss
settings (NeMo-RL's ``loss_fn`` section of a distillation config) of
:class:`rlcore.algorithms.distillation.loss.DistillationLossFn`. Light: importing it never imports the loss."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, PositiveInt, field_validator

from rlcore.config.base import StrictModel
from rlcore.config.overrides import merged_section
from rlcore.config.rollout_loop import RolloutLoopConfig


class DistillationLossConfig(StrictModel):
    """The KL between the teacher's and the student's next-token distributions over the teacher's top-k ids."""

    kl_type: Literal["forward", "reverse", "mixed"] = Field(
        "mixed",
        description="forward: KL(teacher || student); reverse: KL(student || teacher); mixed: "
        "mixed_kl_weight * forward + (1 - mixed_kl_weight) * reverse.",
    )
    mixed_kl_weight: float = Field(0.5, ge=0.0, le=1.0, description="Weight of the forward KL when kl_type is mixed.")
    zero_outside_topk: bool = Field(
        False,
        description="false: both distributions are renormalised over the teacher's top-k ids. true: the "
        "student's full-vocabulary logprobs are used as they are, and a reverse or mixed KL also scores the "
        "student's probability outside the top-k, where the teacher gets log-probability -100 (NeMo-RL's "
        "semantics; needs a backend that computes the loss inputs logprobs_at_indices and entropy).",
    )


class DistillationConfig(RolloutLoopConfig, DistillationLossConfig):
    """On-policy distillation: the student generates, a frozen teacher scores every token of the student's own
    rollouts with its top-k logits, and the student trains on the KL (NeMo-RL's ``distillation`` section, with
    its ``loss_fn`` settings above)."""

    teacher_model_name: str = Field(
        ...,
        description="The teacher: a model directory or a built-in name (tiny-qwen2, qwen2.5-0.5b, ...), frozen, "
        "run with the student's policy settings (precision, backend, parallel layout, batch sizes) except those "
        "distillation.teacher sets. Its vocabulary must be the student's unless distillation.teacher.tokenizer.name "
        "names its own tokenizer. NeMo-RL's teacher.model_name.",
    )
    teacher: dict[str, Any] = Field(
        default_factory=dict,
        description="The teacher's own policy settings, each a policy key over the student's "
        "(e.g. {dtensor_cfg: {tensor_parallel_size: 4}, precision: float32}): the teacher is a Policy of the merge, "
        "with its own parallel layout on the same workers. NeMo-RL's teacher section. tokenizer: {name: ...} only, "
        "the teacher's own tokenizer when its vocabulary is not the student's: the teacher then re-tokenizes the "
        "student's text and its top-k are mapped to the student's positions and ids through the token strings "
        "(cross-tokenizer distillation). Not model_name (teacher_model_name), generation, optimizer or scheduler "
        "(the teacher only scores).",
    )
    topk_logits_k: PositiveInt = Field(
        64, description="How many of the teacher's most likely tokens each position's KL runs over."
    )
    num_generations_per_prompt: PositiveInt = Field(1, description="Completions the student generates per prompt.")
    max_num_steps: PositiveInt = Field(100, description="Training steps (each: generate, teacher top-k, train).")

    @field_validator("teacher")
    @classmethod
    def _teacher_scores_only(cls, value: dict[str, Any]) -> dict[str, Any]:
        for key, fix in TEACHER_NOT_OWN.items():
            if key in value:
                raise ValueError(f"distillation.teacher.{key} is not the teacher's own setting: {fix}")
        tokenizer = value.get("tokenizer", {})
        if not isinstance(tokenizer, dict) or set(tokenizer) - {"name"}:
            other = sorted(set(tokenizer) - {"name"}) if isinstance(tokenizer, dict) else [tokenizer]
            raise ValueError(
                f"distillation.teacher.tokenizer: only its name is the teacher's own (not {other}): the "
                "teacher re-tokenizes the student's text as it is, with no chat template; remove them"
            )
        return value

    def teacher_policy(self, student: Any) -> dict[str, Any]:
        """The teacher's policy settings as a dict: the ``student``'s policy (a ``PolicyConfig``) with
        :attr:`teacher` merged over it, the teacher's model, the student's tokenizer (or the teacher's own, see
        :meth:`teacher_tokenizer`) and no generation."""
        merged = merged_section(student.model_dump(exclude_unset=True), self.teacher)
        tokenizer = student.tokenizer.model_dump(exclude_unset=True)
        if self.teacher_tokenizer(student) is not None:
            tokenizer = {"name": self.teacher_tokenizer(student)}
        return {**merged, "model_name": self.teacher_model_name, "generation": None, "tokenizer": tokenizer}

    def teacher_tokenizer(self, student: Any) -> str | None:
        """The teacher's own tokenizer (``distillation.teacher.tokenizer.name``) when it is not the student's
        (``student``: the student's ``PolicyConfig``); None: the teacher reads the student's token ids."""
        name = self.teacher.get("tokenizer", {}).get("name")
        own = student.tokenizer.name or student.model_name
        return None if name is None or name == own else name

    def loss_settings(self) -> DistillationLossConfig:
        """The loss's settings alone."""
        return DistillationLossConfig(**{k: getattr(self, k) for k in DistillationLossConfig.model_fields})


#: Policy keys the teacher takes from elsewhere, and where.
TEACHER_NOT_OWN = {
    "model_name": "set distillation.teacher_model_name",
    "generation": "the teacher does not generate; remove it",
    "optimizer": "the teacher does not train; remove it",
    "scheduler": "the teacher does not train; remove it",
}
