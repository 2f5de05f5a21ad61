"""Step 0 of ``make gpu-check``: what torch sees, and the one line printed when there is no GPU."""

from __future__ import annotations

import json
import subprocess
from typing import Any

_PROBE = r"""
import json, platform
out = {"python": platform.python_version(), "executable": __import__("sys").executable}
try:
    import torch
except Exception as exc:
    out["error"] = f"torch is not importable: {type(exc).__name__}: {exc}"
else:
    out.update(torch=torch.__version__, cuda_build=torch.version.cuda, cuda=torch.cuda.is_available())
    if out["cuda"]:
        try:
            props = torch.cuda.get_device_properties(0)
            out.update(count=torch.cuda.device_count(), name=props.name,
                       memory_gb=round(props.total_memory / 2**30, 1), capability=f"{props.major}.{props.minor}")
            out["bf16"] = torch.cuda.is_bf16_supported()
            version = torch.cuda.nccl.version()
            out["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        except Exception as exc:
            out["probe_problem"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""


def probe_cuda(python: str) -> dict[str, Any]:
    """What torch sees, from a fresh process (this one never creates a CUDA context)."""
    try:
        proc = subprocess.run([python, "-c", _PROBE], check=False, capture_output=True, text=True, timeout=180)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"error": f"could not run {python}: {exc}"}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"probing torch failed (exit {proc.returncode}): {tail}"}
    return json.loads(lines[-1])


def no_cuda_line(info: dict[str, Any]) -> str | None:
    """The one line printed on a machine without CUDA, or None when there is a GPU to check."""
    if "error" in info:
        return f"gpu-check: no CUDA here ({info['error']}): nothing to check"
    if not info.get("cuda"):
        build = f"CUDA {info['cuda_build']} build" if info.get("cuda_build") else "CPU-only build"
        return f"gpu-check: no CUDA device visible to torch {info.get('torch')} ({build}): nothing to check"
    return None
