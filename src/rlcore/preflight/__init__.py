"""Will this run start? Every check made before Ray starts, in one package, behind one entry point.

``rlcore run``, ``rlcore config validate`` and ``rlcore doctor`` all call :func:`preflight`. Given a resolved
config it checks that config on this machine (:mod:`.config`: the backends' own checks, CUDA, the user's code,
data and prompt files, models and tokenizers, the hub); without one (the doctor) it checks the host and every
installed plugin (:mod:`.machine`: Python, torch and GPUs, each engine's import in a subprocess, each backend's
status and its own checks, shared memory, leftovers of earlier runs, ports). Each check is written once, in the
module of its concern:

- :mod:`.models`: model and tokenizer directories, weights (safetensors headers, pickles, LoRA adapters);
- :mod:`.cuda`, :mod:`.datasets`, :mod:`.hub`, :mod:`.user_code`: CUDA devices, hub datasets and models,
  ``'module:name'`` paths a config names;
- :mod:`.engines`, :mod:`.host`, :mod:`.probe`: torch, GPUs, Ray and engine imports; the machine itself;
- :mod:`.backend_checks`, :mod:`.facts`: what a backend checks itself (``BackendSpec.checks``), on the
  :class:`HostFacts` the core hands it.

Nothing here starts Ray or an engine, and nothing imports torch in this process.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from rlcore.preflight.facts import HostFacts
from rlcore.preflight.models import check_model, check_model_sources, check_policy_sources, hub_offline
from rlcore.preflight.probe import ImportProbe
from rlcore.preflight.result import CheckResult, summarize

if TYPE_CHECKING:
    from rlcore.config import ResolvedConfig


def preflight(
    resolved: ResolvedConfig | None = None,
    *,
    files: bool = True,
    first: Sequence[str] = (),
    sources: Mapping[str, str] | None = None,
    timeout_s: float = 120.0,
) -> list[CheckResult]:
    """What stands between this machine and a run, as check lines.

    With ``resolved`` (``rlcore run``, ``rlcore config validate``): one failed line per problem of that config
    here, named by its dotted key, its message the whole ``<key>: <what>; <fix>`` line
    (:func:`rlcore.preflight.config.run_problems`); empty when the run can start. ``files=False`` skips what
    depends on this machine; ``first``: lines the caller found of its own state, said first; ``sources``: the
    NeMo-RL keys to name beside rlcore's.

    Without (``rlcore doctor``, which has no config): every host and plugin check, ok or not
    (:func:`rlcore.preflight.machine.run_checks`); ``timeout_s`` bounds each engine import.
    """
    if resolved is None:
        from rlcore.preflight.machine import run_checks

        return run_checks(timeout_s=timeout_s)
    from rlcore.preflight.config import run_problems

    lines = run_problems(resolved, files=files, first=first, sources=sources)
    return [CheckResult(line.partition(":")[0], "fail", line) for line in lines]


def problem_lines(results: Sequence[CheckResult]) -> list[str]:
    """The messages of the failed lines: what ``rlcore run`` and ``rlcore config validate`` print."""
    return [r.message for r in results if r.status == "fail"]


__all__ = [
    "CheckResult",
    "HostFacts",
    "ImportProbe",
    "check_model",
    "check_model_sources",
    "check_policy_sources",
    "hub_offline",
    "preflight",
    "problem_lines",
    "summarize",
]
