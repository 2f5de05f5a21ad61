"""``rlcore doctor``: what a run needs on this machine, one line per check.

Checks are cheap and safe: engines are imported only in subprocesses with a
time limit, nothing is started (no Ray, no engine) and the network is never
touched. Each check is a function of the facts it judges, returning a
:class:`CheckResult`; :func:`run_checks` gathers the facts and runs them all.
"""

from rlcore.doctor.result import CheckResult, summarize
from rlcore.doctor.runner import run_checks

__all__ = ["CheckResult", "run_checks", "summarize"]
