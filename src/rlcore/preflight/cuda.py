"""Whether this machine has the CUDA devices a run asks for, found without importing torch.

Importing torch takes seconds (6-7 s on a loaded 2-core machine), more than the whole of a preflight may. The
CUDA driver answers in milliseconds: ``cuInit`` and ``cuDeviceGetCount`` from ``libcuda``, which honour
``CUDA_VISIBLE_DEVICES`` as torch does. They run in a child process, so the run's own process never initialises
CUDA (a process that forks after ``cuInit`` cannot use CUDA in the child).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlcore.config import ClusterConfig

#: Run by a child interpreter: prints the device count, or "error <why>".
_PROBE = r"""
import ctypes
for name in ("libcuda.so.1", "libcuda.so", "libcuda.dylib", "nvcuda.dll"):
    try:
        lib = ctypes.CDLL(name)
        break
    except OSError:
        lib = None
if lib is None:
    print("error no CUDA driver (libcuda) is installed")
else:
    rc = lib.cuInit(0)
    count = ctypes.c_int(0)
    if rc == 0:
        rc = lib.cuDeviceGetCount(ctypes.byref(count))
    if rc == 100:
        print(0)
    elif rc:
        print(f"error the CUDA driver failed to start (CUDA error {rc})")
    else:
        print(count.value)
"""

PROBE_TIMEOUT_S = 20.0


def cuda_devices() -> tuple[int, str]:
    """(the CUDA devices this process may use, why there are none: empty when there are some)."""
    try:
        out = subprocess.run(
            [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 0, f"the CUDA probe failed ({type(exc).__name__})"
    if out.startswith("error "):
        return 0, out.removeprefix("error ")
    try:
        count = int(out.splitlines()[-1])
    except (ValueError, IndexError):
        return 0, f"the CUDA probe said {out[:80]!r}"
    if count:
        return count, ""
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    return 0, ("the CUDA driver sees no device" + (f" (CUDA_VISIBLE_DEVICES={hidden!r})" if hidden is not None else ""))


def torch_cuda_build() -> bool | None:
    """Whether the installed torch is built with CUDA (read from ``torch/version.py`` without importing torch);
    None when that cannot be told."""
    import ast
    import importlib.util

    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    version = Path(next(iter(spec.submodule_search_locations))) / "version.py"
    try:
        tree = ast.parse(version.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None
    for node in tree.body:
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        if any(getattr(t, "id", None) == "cuda" for t in targets):
            value = getattr(node, "value", None)
            return not (isinstance(value, ast.Constant) and value.value is None)
    return None


def gpu_problems(cluster: ClusterConfig) -> list[str]:
    """``cluster.use_gpu`` where this machine cannot give the workers CUDA devices, one line each. Only for a
    private local Ray (``cluster.ray_address`` null): an attached cluster's GPUs are on other machines."""
    if not cluster.use_gpu or cluster.ray_address is not None:
        return []
    count, why = cuda_devices()
    if not count:
        return [
            f"cluster.use_gpu: is true, but this machine has no CUDA device ({why}); set cluster.use_gpu=false "
            "to train on CPU, or run where there are GPUs"
        ]
    if torch_cuda_build() is False:
        return [
            f"cluster.use_gpu: is true, but the installed torch is a CPU build (this machine has {count} CUDA "
            "device(s)); install a CUDA build of torch, or set cluster.use_gpu=false to train on CPU"
        ]
    if cluster.num_nodes == 1 and cluster.workers_per_node > count:
        return [
            f"cluster.workers_per_node: is {cluster.workers_per_node}, one GPU each, but this machine has "
            f"{count} CUDA device(s); set cluster.workers_per_node={count} or less"
        ]
    return []


__all__ = ["cuda_devices", "gpu_problems", "torch_cuda_build"]
