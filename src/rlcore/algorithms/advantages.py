"""Moved: GRPO's advantages live in GRPO's package, :mod:`rlcore.algorithms.grpo.advantages`
(rlcore 0.2). This path re-exports it for one release and warns."""

import warnings

from rlcore.algorithms.grpo.advantages import *  # noqa: F403
from rlcore.algorithms.grpo.advantages import __all__  # noqa: F401

warnings.warn(
    "rlcore.algorithms.advantages moved to rlcore.algorithms.grpo.advantages; import from there "
    "(the old path goes in the next minor release)",
    DeprecationWarning,
    stacklevel=2,
)
