"""Moved: a config's preflight is :mod:`rlcore.preflight` (:func:`rlcore.preflight.preflight`, the entry point
``rlcore run``, ``rlcore config validate`` and ``rlcore doctor`` share; the config's checks in
:mod:`rlcore.preflight.config`). This path re-exports them for one release and warns; it goes in the release
after."""

import warnings

from rlcore.preflight.config import code_problems, file_problems, run_problems

warnings.warn(
    "rlcore.run.preflight moved to rlcore.preflight (rlcore.preflight.preflight(resolved)); "
    "this alias goes in the next release",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["code_problems", "file_problems", "run_problems"]
