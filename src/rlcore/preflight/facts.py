"""What the core found on this machine, handed to a backend's own checks (``BackendSpec.checks``).

A backend's checks judge these facts and return :class:`~rlcore.preflight.result.CheckResult` lines; they
gather nothing the core already has (the installed distributions, the engine imports of ``rlcore doctor``).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rlcore.preflight.probe import ImportProbe

if TYPE_CHECKING:
    from rlcore.config import ResolvedConfig


@dataclass(frozen=True)
class HostFacts:
    """The facts a backend's ``checks`` function is called with.

    ``installed``: ``{normalized distribution name: version}`` (package metadata, nothing imported).
    ``probes``: what ``rlcore doctor`` imported in its probe processes, by target (``"torch"``, a
    backend's ``import_check`` such as ``"vllm:LLM"``); empty before a run, which imports nothing.
    ``config``: the resolved config of the run about to start (``rlcore run``, ``rlcore config validate``);
    None in ``rlcore doctor``, which has none. ``cpuinfo``: the text of ``/proc/cpuinfo`` (empty elsewhere).
    ``python``: the interpreter a fix line should name.
    """

    installed: Mapping[str, str]
    probes: Mapping[str, ImportProbe] = field(default_factory=dict)
    config: ResolvedConfig | None = None
    cpuinfo: str = ""
    python: str = sys.executable

    @property
    def torch(self) -> ImportProbe | None:
        """The probe of ``import torch`` (None before a run, or where torch is not installed)."""
        return self.probes.get("torch")

    @property
    def gpus(self) -> int:
        """CUDA devices torch saw in the doctor's probe (0 when it did not import, or was not imported)."""
        probe = self.torch
        return len(probe.info.get("device_names") or []) if probe is not None and probe.ok else 0


__all__ = ["HostFacts"]
