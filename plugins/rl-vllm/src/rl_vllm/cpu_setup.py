"""Process set-up the vLLM engine needs on a CPU host.

``request_amx_permission`` is registered as a ``vllm.general_plugins`` entry
point, so vLLM calls it in every process it runs an engine or a worker in,
including the ones it spawns itself. On Linux a process must ask the kernel
for permission to use the AMX tile registers (``arch_prctl``) before running
an AMX instruction; torch's bf16 CPU kernels use AMX when the CPU has it, and
without the permission the first bf16 matmul dies with SIGILL. torch does the
request in ``torch.cpu._init_amx()``. The call is idempotent, harmless on
CPUs without AMX and on GPU hosts, and never raises.
"""

from __future__ import annotations

import os

_done = False


def request_amx_permission() -> bool:
    """Ask for AMX permission in this process once; True if granted (or already granted)."""
    global _done
    if _done:
        return True
    if os.environ.get("RL_VLLM_SKIP_AMX") == "1":
        return False
    try:
        import torch

        init = getattr(torch.cpu, "_init_amx", None)
        granted = bool(init()) if init is not None else False
    except Exception:  # noqa: BLE001 - a set-up hook must never break engine start
        return False
    _done = granted
    return granted
