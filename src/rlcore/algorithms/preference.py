"""Moved: DPO's loss lives in DPO's package, :mod:`rlcore.algorithms.dpo.loss`
(rlcore 0.2). This path re-exports it for one release and warns."""

import warnings

from rlcore.algorithms.dpo.loss import *  # noqa: F403
from rlcore.algorithms.dpo.loss import __all__  # noqa: F401

warnings.warn(
    "rlcore.algorithms.preference moved to rlcore.algorithms.dpo.loss; import from there "
    "(the old path goes in the next minor release)",
    DeprecationWarning,
    stacklevel=2,
)
