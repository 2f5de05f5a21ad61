"""Peak memory and time of the token-logprob forward + backward, whole vs ``policy.logprob_chunk_size`` chunks.

Each measurement runs in a fresh process: it builds ``[1, S, V]`` logits (a leaf, as a model's output is to
this computation), records its resident memory, runs ``rlcore.training.logprobs.token_logprobs`` (what the
reference and fsdp1 backends call; dtensor and megatron call the same chunked function on their vocabulary
slice) and a backward, and reports the growth of its peak resident set. The floor is what any method must
hold beside the logits: their gradient (same dtype and size). Sides alternate (warm-up, then in turns);
medians of ``--repeats``.

    python benchmarks/logprob_chunks.py --seq 2048 --vocab 151936 --chunks 0,1024,256 --dtype bfloat16

The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from interleave import interleaved  # noqa: E402 - benchmarks are scripts, not a package


def _rss_kb() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


def measure_here(seq: int, vocab: int, chunk: int, dtype: str) -> dict:
    """One forward + backward in this process: ``{"peak_mb", "seconds"}`` (peak growth over the logits)."""
    import resource

    import torch

    from rlcore.training.logprobs import token_logprobs

    for warm in (None, 2):  # imports and autograd's first-use allocations stay out of the measurement
        small = torch.zeros(1, 4, 8, requires_grad=True)
        token_logprobs(small, torch.zeros(1, 4, dtype=torch.long), torch.tensor([4]), chunk_size=warm).sum().backward()
    torch.manual_seed(0)
    logits = torch.randn(1, seq, vocab, dtype=getattr(torch, dtype)).requires_grad_(True)
    ids = torch.randint(0, vocab, (1, seq))
    lengths = torch.tensor([seq])
    before = max(_rss_kb(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    began = time.perf_counter()
    lp = token_logprobs(logits, ids, lengths, chunk_size=chunk or None)
    lp.sum().backward()
    seconds = time.perf_counter() - began
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"peak_mb": (peak - before) / 1024, "seconds": seconds}


def measure(seq: int, vocab: int, chunk: int, dtype: str, threads: int) -> dict:
    code = (
        f"import json, sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); import torch; "
        f"torch.set_num_threads({threads}); from logprob_chunks import measure_here; "
        f"print(json.dumps(measure_here({seq}, {vocab}, {chunk}, {dtype!r})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=151936, help="151936: Qwen2.5's vocabulary")
    parser.add_argument("--chunks", default="0,1024,256", help="comma-separated; 0 = whole (no chunking)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()

    chunks = [int(c) for c in args.chunks.split(",")]
    runs = interleaved(chunks, lambda c: measure(args.seq, args.vocab, c, args.dtype, args.threads), args.repeats)
    itemsize = 2 if args.dtype == "bfloat16" else 4
    floor_mb = args.seq * args.vocab * itemsize / 2**20  # the logits' gradient
    whole = statistics.median(r["peak_mb"] for r in runs[0]) if 0 in runs else None
    whole_s = statistics.median(r["seconds"] for r in runs[0]) if 0 in runs else None
    print(
        f"S={args.seq} V={args.vocab} {args.dtype}, {args.threads} threads, load {os.getloadavg()[0]:.2f}; "
        f"floor (the logits' gradient) {floor_mb:.0f} MB; medians of {args.repeats}"
    )
    print(f"{'chunk':>8} {'peak MB':>9} {'x floor':>8} {'seconds':>8} {'x whole time':>12}")
    rows = []
    for chunk in chunks:
        peak = statistics.median(r["peak_mb"] for r in runs[chunk])
        seconds = statistics.median(r["seconds"] for r in runs[chunk])
        row = {
            "chunk": chunk or None,
            "peak_mb": round(peak, 1),
            "x_floor": round(peak / floor_mb, 2),
            "seconds": round(seconds, 3),
            "x_whole_time": round(seconds / whole_s, 2) if whole_s else None,
            "x_whole_memory": round(peak / whole, 3) if whole else None,
        }
        rows.append(row)
        print(f"{chunk or 'whole':>8} {peak:>9.0f} {row['x_floor']:>8} {seconds:>8.3f} {row['x_whole_time']!s:>12}")
    print(
        json.dumps(
            {"seq": args.seq, "vocab": args.vocab, "dtype": args.dtype, "floor_mb": round(floor_mb, 1), "rows": rows}
        )
    )


if __name__ == "__main__":
    main()
