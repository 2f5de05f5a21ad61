"""Abstract contracts every backend implements."""

from rlcore.interfaces.generation import GenerationInterface
from rlcore.interfaces.loss import LossFunction, LossType
from rlcore.interfaces.policy import ColocatablePolicyInterface, PolicyInterface
from rlcore.interfaces.specs import (
    GenerationDatumSpec,
    GenerationOutputSpec,
    LogprobOutputSpec,
    ReferenceLogprobOutputSpec,
    ScoreOutputSpec,
    TopkLogitsOutputSpec,
)

__all__ = [
    "ColocatablePolicyInterface",
    "GenerationDatumSpec",
    "GenerationInterface",
    "GenerationOutputSpec",
    "LogprobOutputSpec",
    "LossFunction",
    "LossType",
    "PolicyInterface",
    "ReferenceLogprobOutputSpec",
    "ScoreOutputSpec",
    "TopkLogitsOutputSpec",
]
