"""Abstract contracts every backend implements."""

from rlcore.interfaces.generation import PAUSE_MODES, GenerationInterface, PauseMode
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
    "PAUSE_MODES",
    "ColocatablePolicyInterface",
    "GenerationDatumSpec",
    "GenerationInterface",
    "GenerationOutputSpec",
    "LogprobOutputSpec",
    "LossFunction",
    "LossType",
    "PauseMode",
    "PolicyInterface",
    "ReferenceLogprobOutputSpec",
    "ScoreOutputSpec",
    "TopkLogitsOutputSpec",
]
