"""Moved: GRPO's reward transforms live in GRPO's package, :mod:`rlcore.algorithms.grpo.reward_transforms`
(rlcore 0.2). This path re-exports it for one release and warns."""

import warnings

from rlcore.algorithms.grpo.reward_transforms import *  # noqa: F403
from rlcore.algorithms.grpo.reward_transforms import __all__  # noqa: F401

warnings.warn(
    "rlcore.algorithms.reward_transforms moved to rlcore.algorithms.grpo.reward_transforms; import from there "
    "(the old path goes in the next minor release)",
    DeprecationWarning,
    stacklevel=2,
)
