"""On-policy distillation's loss settings (NeMo-RL's ``loss_fn`` section of a distillation config): the config of
:class:`rlcore.algorithms.distillation.DistillationLossFn`, kept with the other sections so that the config never
imports the losses."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rlcore.config.base import StrictModel


class DistillationLossConfig(StrictModel):
    """The KL between the teacher's and the student's next-token distributions over the teacher's top-k ids."""

    kl_type: Literal["forward", "reverse", "mixed"] = Field(
        "mixed", description="forward: KL(teacher || student); reverse: KL(student || teacher); mixed: "
        "mixed_kl_weight * forward + (1 - mixed_kl_weight) * reverse.")
    mixed_kl_weight: float = Field(0.5, ge=0.0, le=1.0, description="Weight of the forward KL when kl_type is "
                                   "mixed.")
    zero_outside_topk: bool = Field(
        False, description="NeMo-RL's option to score the student's probability mass outside the teacher's top-k "
        "(it needs the student's full-vocabulary entropy); not offered: must be false, which renormalises both "
        "distributions over the top-k ids.")

    @model_validator(mode="after")
    def _only_within_topk(self) -> "DistillationLossConfig":
        if self.zero_outside_topk:
            raise ValueError("zero_outside_topk=true is not offered by rlcore (it needs the student's "
                             "full-vocabulary entropy as a loss input); set it to false: both distributions are "
                             "renormalised over the teacher's top-k ids")
        return self
