"""Moved: ``rlcore doctor``'s checks are part of :mod:`rlcore.preflight`, the one home of "will this run start?"
(:func:`rlcore.preflight.preflight` without a config runs them). This path re-exports the doctor's names for one
release and warns; it goes in the release after."""

import warnings

from rlcore.preflight.machine import run_checks
from rlcore.preflight.result import CheckResult, summarize

warnings.warn(
    "rlcore.doctor moved to rlcore.preflight (rlcore.preflight.preflight() runs the doctor's checks); "
    "this alias goes in the next release",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["CheckResult", "run_checks", "summarize"]
