"""How long does a weight refit take, compared with just moving the same bytes?

One training ``Policy`` (``--backend``, one rank) and two vLLM engines
(``VllmGeneration``) of a >= 100M-parameter Llama built from a config
(float32):

- **colocated**: an engine sharing the training rank's bundle
  (``max_colocated_worker_groups=2``); ``WeightSynchronizer`` streams packed
  buckets through shared memory;
- **collective**: an engine on its own one-bundle cluster; the synchronizer
  broadcasts packed buckets over a gloo group (training rank 0 -> engine).

Each ``sync_weights()`` is timed in the driver, against three baselines of the
same weights measured in the same run:

- **floor**: the engine's own in-process reload of the same tensors, already in
  its memory (an in-process engine in the driver, ``InPlaceReload`` over the
  state dict in the refit's bucket order): what no transport can beat;
- **memcpy**: one ``torch`` copy of a uint8 tensor of that size into an
  already-touched tensor (driver process, one torch thread, like the ranks);
- **broadcast**: one raw gloo broadcast of a tensor of that size between two
  processes (one thread each), timed on the sender between barriers.

Everything is warmed up once, then the five measurements are interleaved
``--repeats`` times (so load from other processes hits them alike) and the
medians are reported.

``--breakdown`` then profiles, in this process, the stages a colocated refit is
made of: packing the tensors into a bucket buffer (sender), the receiver's
copies of layers split over buckets, and vLLM's layerwise ``load_weights``
(+ ``finalize``), so a missed goal can be explained.

    python benchmarks/refit.py [--backend reference] [--model-dir DIR] [--repeats 5] [--breakdown]
    python benchmarks/refit.py --fingerprint [--repeats 9]   # verified refit's cost, CPU, no vLLM
    python benchmarks/refit.py --pack [--repeats 9]          # fused vs per-tensor packing, CPU, no vLLM

The pieces: ``refit_sides.py`` (the model, rlcore's refits, the engine's floor and breakdown),
``refit_baselines.py`` (memcpy, raw broadcast), ``refit_cpu.py`` (``--fingerprint``, ``--pack``).

The last line printed is JSON with ``colocated_vs_floor`` and ``collective_vs_floor``
(collective over max(broadcast, floor)); goals <= 1.25 each, beside the
earlier ``colocated_vs_memcpy`` / ``collective_vs_broadcast`` ratios; with ``--fingerprint``,
``fingerprint_vs_refit`` (wall) and ``fingerprint_vs_refit_cpu`` (CPU seconds), goal <= 0.05 (issue 44).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the refit_*.py beside this script

from refit_baselines import RawBroadcast, time_memcpy  # noqa: E402
from refit_cpu import fingerprint_cost, interleaved_refits  # noqa: E402
from refit_sides import KV_CACHE_GB, MODEL, TRANSPORTS, InProcessEngine, Refits, breakdown, model_params  # noqa: E402,F401

KINDS = ("memcpy", "broadcast", "floor", *TRANSPORTS)


def measure(
    backend: str, model_dir: str, engine: InProcessEngine, repeats: int, transports: tuple[str, ...] = TRANSPORTS
) -> tuple[dict[str, list[float]], int]:
    """One warm-up of each, then ``repeats`` interleaved rounds of the measurements (seconds)."""
    refits = Refits(backend, model_dir, transports)
    try:
        for transport in transports:
            _, nbytes = refits.run(transport)  # warm-up (metadata exchange, group set-up)
        engine.floor()
        raw = RawBroadcast(nbytes)
        try:
            raw.run()
            time_memcpy(nbytes)
            times: dict[str, list[float]] = {k: [] for k in ("memcpy", "broadcast", "floor", *transports)}
            for _ in range(repeats):
                times["memcpy"].append(time_memcpy(nbytes))
                times["broadcast"].append(raw.run())
                times["floor"].append(engine.floor())
                for transport in transports:
                    times[transport].append(refits.run(transport)[0])
        finally:
            raw.close()
    finally:
        refits.close()
    return times, nbytes


def figures(times: dict[str, list[float]], nbytes: int) -> dict:
    """Medians and the ratios of the JSON line (those of the transports measured)."""
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {"bytes": nbytes, **{f"{k}_s": round(v, 4) for k, v in med.items()}}
    if "colocated" in med:
        result["colocated_vs_floor"] = round(med["colocated"] / med["floor"], 2)
        result["colocated_vs_memcpy"] = round(med["colocated"] / med["memcpy"], 2)
    if "collective" in med:
        result["collective_vs_floor"] = round(med["collective"] / max(med["broadcast"], med["floor"]), 2)
        result["collective_vs_broadcast"] = round(med["collective"] / med["broadcast"], 2)
    return {**result, "load_average": round(os.getloadavg()[0], 1)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="reference", help="training backend (reference, dtensor, ...)")
    parser.add_argument("--model-dir", help="a float32 HF model directory (default: the ~134M Llama above)")
    parser.add_argument(
        "--transports",
        default=",".join(TRANSPORTS),
        help="which refits to time (one at a time holds one engine less: the 0.5B preset on 24 GB)",
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--breakdown", action="store_true", help="also profile the stages of a colocated refit")
    parser.add_argument(
        "--fingerprint",
        action="store_true",
        help="only: a CPU shared-memory refit with verified-refit fingerprints on vs off (no vLLM)",
    )
    parser.add_argument(
        "--pack",
        action="store_true",
        help="only: a CPU shared-memory refit packed tensor by tensor vs one fused copy per bucket",
    )
    args = parser.parse_args(argv)
    if args.fingerprint:
        print(json.dumps(fingerprint_cost(args.repeats)))
        return
    if args.pack:
        print(json.dumps(interleaved_refits(("per_tensor", "fused"), args.repeats)))
        return

    import torch
    import transformers

    from rlcore.distributed import shutdown_ray
    from rlcore.refit import DEFAULT_BUCKET_BYTES
    from rlcore.testing.models import tiny_model_path

    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    model_dir = args.model_dir or tiny_model_path(**MODEL)
    params = model_params(model_dir)
    print(
        f"model: {model_dir if args.model_dir else f'llama {MODEL}'}, {params / 1e6:.1f}M params float32; "
        f"backend {args.backend!r} (1 rank); {args.repeats} repeats after 1 warm-up; "
        f"load average {os.getloadavg()[0]:.1f}",
        file=sys.stderr,
    )

    engine = InProcessEngine(model_dir, DEFAULT_BUCKET_BYTES)
    try:
        try:
            times, nbytes = measure(args.backend, model_dir, engine, args.repeats, tuple(args.transports.split(",")))
        finally:
            shutdown_ray()
        result = figures(times, nbytes)
        print(f"{nbytes / 1e6:.1f} MB per refit (bucket {DEFAULT_BUCKET_BYTES >> 20} MiB)")
        print(f"{'median seconds':<26}{'s':>9}{'GB/s':>8}{'min s':>9}{'max s':>9}")
        for k in times:
            med = result[f"{k}_s"]
            print(f"{k:<26}{med:>9.3f}{nbytes / med / 1e9:>8.2f}{min(times[k]):>9.3f}{max(times[k]):>9.3f}")
        print(
            f"colocated / floor {result.get('colocated_vs_floor')}x, collective / max(broadcast, floor) "
            f"{result.get('collective_vs_floor')}x (goals <= 1.25); colocated / memcpy "
            f"{result.get('colocated_vs_memcpy')}x, collective / broadcast {result.get('collective_vs_broadcast')}x"
        )
        if args.breakdown:
            stages, top = breakdown(engine, max(2, args.repeats // 2))
            print("colocated refit, stage by stage (in process, no Ray; median seconds, x this run's floor):")
            for k, v in stages.items():
                print(f"  {k:<24}{v:>8.3f}{v / result['floor_s']:>8.2f}x")
            print("  inside load_weights (cProfile tottime of one pass):")
            for func, seconds in top:
                print(f"    {func:<40}{seconds:>8.3f}")
            result["breakdown"] = {k: round(v, 4) for k, v in stages.items()}
    finally:
        engine.close()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
