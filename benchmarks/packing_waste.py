"""Padding waste of fixed-size padded micro-batches vs. sequence packing.

Draws a long-tailed (lognormal) length distribution with a fixed seed and
reports, for padded micro-batches (each padded to its own longest sequence),
dynamic batching and each packing algorithm: micro-batches/bins used, padding
waste ``1 - useful tokens / allocated tokens`` and the time to plan.

    python benchmarks/packing_waste.py [--n 4000] [--capacity 4096] [--mbs 4]

Waste counts padded (computed but useless) tokens. Dynamic batching pads
little but leaves part of each micro-batch's token budget unused, so it needs
more micro-batches than packing needs bins.

The last line is JSON with the headline numbers. Pure Python: no torch.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time

from rlcore.data.dynamic_batching import plan_dynamic_microbatches
from rlcore.data.packing import ALGORITHMS, pack_sequences


def lengths_lognormal(n: int, capacity: int, seed: int) -> list[int]:
    """Median ~600 tokens, heavy right tail, clipped to [16, capacity]."""
    rng = random.Random(seed)
    return [min(capacity, max(16, int(rng.lognormvariate(math.log(600), 0.9)))) for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=4000)
    ap.add_argument("--capacity", type=int, default=4096)
    ap.add_argument("--mbs", type=int, default=4, help="padded baseline micro-batch size")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    lengths = lengths_lognormal(a.n, a.capacity, a.seed)
    useful = sum(lengths)
    rows: list[tuple[str, int, float, float]] = []

    t = time.perf_counter()
    alloc = sum(len(lengths[i : i + a.mbs]) * max(lengths[i : i + a.mbs]) for i in range(0, a.n, a.mbs))
    rows.append((f"padded (mbs={a.mbs})", -(-a.n // a.mbs), 1 - useful / alloc, time.perf_counter() - t))
    padded_waste = 1 - useful / alloc

    t = time.perf_counter()
    plan = plan_dynamic_microbatches([lengths], a.capacity)[0]
    dt = time.perf_counter() - t
    alloc = sum(len(mb) * n for mb, n in zip(plan.micro_batches, plan.padded_lengths))
    rows.append(("dynamic batching", len(plan.micro_batches), 1 - useful / alloc, dt))

    results = {}
    for algo in ALGORITHMS:
        t = time.perf_counter()
        bins = pack_sequences(lengths, a.capacity, algo)
        dt = time.perf_counter() - t
        waste = 1 - useful / (len(bins) * a.capacity)
        results[algo] = (len(bins), waste)
        rows.append((algo, len(bins), waste, dt))

    lower = math.ceil(useful / a.capacity)
    print(
        f"{a.n} sequences, lognormal lengths (median 600, mean {useful / a.n:.0f}, "
        f"max {max(lengths)}), capacity {a.capacity}, lower bound {lower} bins"
    )
    print(f"{'method':<32}{'mbs/bins':>10}{'waste':>10}{'time ms':>10}")
    for name, count, waste, dt in rows:
        print(f"{name:<32}{count:>10}{waste:>10.2%}{dt * 1e3:>10.1f}")
    print(
        json.dumps(
            {
                "padded_waste": round(padded_waste, 4),
                "mffd_waste": round(results["modified_first_fit_decreasing"][1], 4),
                "ffd_waste": round(results["first_fit_decreasing"][1], 4),
                "concatenative_waste": round(results["concatenative"][1], 4),
                "mffd_bins": results["modified_first_fit_decreasing"][0],
                "lower_bound_bins": lower,
            }
        )
    )


if __name__ == "__main__":
    main()
