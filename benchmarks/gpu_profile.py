"""Where a step's GPU time goes: a torch profiler trace summed by kernel and by kind of kernel.

``benchmarks/gpu.py --profile`` profiles one more optimizer step of each side (raw torch and each
backend) after the timed ones and prints the summaries side by side, so that a backend's extra time
over the raw step shows up as kernels the raw step does not run, or as idle GPU time (``span``
minus ``busy``: the GPU waiting for the host).
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

#: Kinds of kernel, by a substring of the kernel's name (first match wins, lower case).
KINDS = (
    ("nccl", "collective"),
    ("flash", "attention"),
    ("fmha", "attention"),
    ("attention", "attention"),
    ("gemm", "matmul"),
    ("nvjet", "matmul"),
    ("xmma", "matmul"),
    ("cutlass", "matmul"),
    ("reduce", "reduction"),
    ("softmax", "softmax"),
    ("memcpy", "copy"),
    ("memset", "copy"),
    ("copy", "copy"),
    ("cast", "elementwise"),
    ("elementwise", "elementwise"),
    ("vectorized", "elementwise"),
)
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def kind_of(name: str) -> str:
    lower = name.lower()
    return next((kind for key, kind in KINDS if key in lower), "other")


def summarize_trace(path: str | Path, top: int = 12) -> dict[str, Any]:
    """GPU busy time, the span from the first kernel to the last, and the largest kernels of a trace."""
    events = json.loads(Path(path).read_text())["traceEvents"]
    gpu = [e for e in events if e.get("cat") in GPU_CATEGORIES and "dur" in e]
    if not gpu:
        return {"error": f"no GPU events in {path}"}
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    by_kind: dict[str, float] = defaultdict(float)
    for e in gpu:
        entry = by_name[e["name"]]
        entry[0] += e["dur"]
        entry[1] += 1
        by_kind[kind_of(e["name"])] += e["dur"]
    busy = sum(e["dur"] for e in gpu)
    span = max(e["ts"] + e["dur"] for e in gpu) - min(e["ts"] for e in gpu)
    largest = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "gpu_busy_s": round(busy / 1e6, 4),
        "gpu_span_s": round(span / 1e6, 4),
        "kernels": len(gpu),
        "by_kind_s": {k: round(v / 1e6, 4) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "top": [[name[:100], round(us / 1e3, 2), int(n)] for name, (us, n) in largest],
    }


def profile_dir() -> Path | None:
    """The folder traces go to when ``--profile`` is on (``RLCORE_PROFILE_DIR``, which the workers read)."""
    value = os.environ.get("RLCORE_PROFILE_DIR")
    return Path(value) if value else None


def print_profiles(profiles: dict[str, dict[str, Any]], file: Any) -> None:
    for side, p in profiles.items():
        if "error" in p:
            print(f"[profile] {side}: {p['error']}", file=file)
            continue
        kinds = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in p["by_kind_s"].items())
        print(
            f"[profile] {side}: GPU busy {p['gpu_busy_s'] * 1e3:.0f} ms of a {p['gpu_span_s'] * 1e3:.0f} ms span, "
            f"{p['kernels']} kernels; ms by kind: {kinds}",
            file=file,
        )
        for name, ms, count in p["top"]:
            print(f"[profile]   {ms:9.1f} ms {count:6d}x  {name}", file=file)
