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
    python benchmarks/refit.py --tp 2 [--model-dir DIR]      # an engine of tensor_parallel_size 2 (below)
    python benchmarks/refit.py --fingerprint [--repeats 9]   # verified refit's cost, CPU, no vLLM
    python benchmarks/refit.py --pack [--repeats 9]          # fused vs per-tensor packing, CPU, no vLLM

The pieces: ``refit_sides.py`` (the model, rlcore's refits, the engine's floor and breakdown),
``refit_baselines.py`` (memcpy, raw broadcast), ``refit_cpu.py`` (``--fingerprint``, ``--pack``).

``--tp N``: one engine of ``tensor_parallel_size`` N over N bundles beside N ``--backend`` training ranks
(colocated: rank r streams to engine rank r the slices engine rank r reads; collective: rank 0 broadcasts the
whole model to all N), against that engine's own floor: every rank's in-place reload of the checkpoint already
in its memory, run on all ranks at once (``VllmGenerationWorker.reload_floor``); JSON ``tp_colocated_vs_floor`` /
``tp_collective_vs_floor``, goal <= 1.10 (issue 53), and ``tp_collective_vs_max_broadcast_floor`` (a raw gloo
broadcast of the same bytes to N processes). ``*_cpu_training_s`` / ``*_cpu_engine_s``: the CPU seconds all
ranks of a side spent in one floor / refit (every thread: gloo's too), which matter more than wall time when
the ranks share cores.

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

from rlcore.refit.buckets import nbytes as nbytes_of  # noqa: E402

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


def measure_tp(backend: str, model_dir: str, tp: int, repeats: int) -> dict:
    """Median seconds of the floor, of both refits into one engine of ``tensor_parallel_size`` ``tp`` and of a raw
    gloo broadcast of the refit's bytes to ``tp`` processes; and the CPU seconds each side spent in them."""
    import ray

    from rl_vllm.generation import VllmGeneration
    from rlcore.config import load_config_dict
    from rlcore.distributed import RayVirtualCluster
    from rlcore.policy import Policy
    from rlcore.refit import DEFAULT_BUCKET_BYTES, WeightSynchronizer
    from rlcore.testing.models import build_tiny_tokenizer

    gen = {"backend": "vllm", "max_new_tokens": 8, "pad_token_id": 0}
    gen["vllm_cfg"] = {"kv_cache_space_gb": KV_CACHE_GB, "max_model_len": 128, "tensor_parallel_size": tp}
    policy_cfg = {"backend": backend, "model_name": model_dir, "precision": "float32", "generation": gen}
    policy_cfg.update(train_global_batch_size=tp, train_micro_batch_size=1, max_total_sequence_length=64)
    cfg = load_config_dict({"cluster": {"workers_per_node": tp}, "policy": policy_cfg}).policy
    cluster = RayVirtualCluster([tp], max_colocated_worker_groups=2)
    policy = generation = raw = None
    try:
        policy = Policy(cluster, cfg, build_tiny_tokenizer(), name_prefix="bench-tp", init_reference_model=False)
        generation = VllmGeneration(cluster, cfg.generation, name_prefix="bench-tp-vllm")
        sides = {"training": policy.worker_group.worker_pids(), "engine": generation.worker_group.worker_pids()}
        syncs = {
            "colocated": WeightSynchronizer(policy, generation, colocated=True),
            "collective": WeightSynchronizer(policy, generation, colocated=False, cluster=cluster),
        }
        nbytes = sum(nbytes_of(shape, dtype) for shape, dtype in policy.prepare_refit_info().values())
        raw = RawBroadcast(nbytes, receivers=tp)

        def floor() -> float:
            calls = generation.worker_group.run_all_workers_single_data("reload_floor", DEFAULT_BUCKET_BYTES)
            return max(ray.get(calls.refs))

        def refit(which: str) -> float:
            return float(syncs[which].sync_weights()["seconds"])

        steps = {
            "floor": floor,
            "colocated": lambda: refit("colocated"),
            "collective": lambda: refit("collective"),
            "broadcast": raw.run,
        }
        for step in steps.values():
            step()  # warm-up: metadata, the group, the floor's copy of the checkpoint, the engines' regions
        times: dict[str, list[float]] = {k: [] for k in steps}
        cpu: dict[str, dict[str, list[float]]] = {k: {side: [] for side in sides} for k in steps if k != "broadcast"}
        for _ in range(repeats):
            for name, step in steps.items():
                before = {side: sum(cpu_seconds(pid) for pid in pids) for side, pids in sides.items()}
                times[name].append(step())
                for side, pids in sides.items():
                    if name in cpu:
                        cpu[name][side].append(sum(cpu_seconds(pid) for pid in pids) - before[side])
    finally:
        if raw is not None:
            raw.close()
        for owner in (generation, policy):
            if owner is not None:
                owner.shutdown()
        cluster.shutdown()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "tp": tp,
        "bytes": nbytes,
        **{f"{k}_s": round(v, 4) for k, v in med.items()},
        # CPU seconds of all ranks of a side together (utime + stime of their processes, every thread)
        **{f"{k}_cpu_{side}_s": round(statistics.median(v), 3) for k, by in cpu.items() for side, v in by.items()},
        "tp_colocated_vs_floor": round(med["colocated"] / med["floor"], 2),
        "tp_collective_vs_floor": round(med["collective"] / med["floor"], 2),
        "tp_collective_vs_max_broadcast_floor": round(med["collective"] / max(med["broadcast"], med["floor"]), 2),
        "load_average": round(os.getloadavg()[0], 1),
    }


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far, all its threads (Linux ``/proc``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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
    parser.add_argument("--tp", type=int, default=1, help="only: refits into one engine of this tensor_parallel_size")
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

    if args.tp > 1:
        try:
            print(json.dumps(measure_tp(args.backend, model_dir, args.tp, args.repeats)))
        finally:
            shutdown_ray()
        return

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
