"""Where a refit into a tensor-parallel vLLM engine spends its time, per rank and stage (issue 53).

The placement of ``refit.py --tp N`` (N ``reference`` training ranks, one engine of ``tensor_parallel_size`` N
on the same bundles). Timers are put around the refit's stages inside every training and engine actor (the
module functions each side calls: packing, waiting on the socket or the broadcast, unpacking, fingerprints,
vLLM's ``load_weights`` and finalize); per stage the wall seconds and the CPU seconds of the calling thread are
summed over one refit. Each process's whole CPU seconds (every thread: gloo's send/receive threads too) come
from ``/proc``. Medians over ``--repeats`` rounds of floor, colocated and collective, after one warm-up each.

    python benchmarks/refit_tp_profile.py [--tp 2] [--model-dir DIR] [--repeats 3] [--verify]

Prints one table per step and, as its last line, JSON ``{step: {"sent": {"bytes"}, rank: {"cpu_s", stage:
[wall_s, cpu_s]}}}`` (``bytes``: what the busiest training rank sent).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the refit_*.py beside this script

from refit import cpu_seconds  # noqa: E402
from refit_sides import KV_CACHE_GB, MODEL  # noqa: E402

#: ``(module, attribute path, stage)``: what is timed in each actor (those a process does not import are skipped).
TIMED = (
    ("rlcore.refit.collective", "pack", "pack"),
    ("rlcore.refit.shared_memory", "pack", "pack"),
    ("rlcore.refit.collective", "unpack", "unpack"),
    ("rlcore.refit.shared_memory", "unpack", "unpack"),
    ("rlcore.refit.collective", "_Pending.wait", "broadcast wait"),
    ("rlcore.refit.shared_memory", "_recv", "socket wait"),
    ("rlcore.refit.fingerprint", "Fingerprints.add", "fingerprints"),
    ("rlcore.refit.fingerprint", "Fingerprints.result", "fingerprints"),
    ("rl_vllm.refit", "InPlaceReload.load", "load_weights"),
    ("rl_vllm.refit", "InPlaceReload._finalize", "finalize"),
)


def install_timers(_host: Any) -> int:
    """Run in an actor (``__ray_call__``): wrap the :data:`TIMED` functions; returns the actor's pid."""
    import builtins
    import functools
    import importlib
    import time

    totals: dict[str, list[float]] = {}
    builtins._refit_profile = totals  # type: ignore[attr-defined]  # read back by take_timers in this process
    for module_name, path, stage in TIMED:
        try:
            owner: Any = importlib.import_module(module_name)
        except ImportError:
            continue
        *parents, name = path.split(".")
        for parent in parents:
            owner = getattr(owner, parent)
        original = getattr(owner, name)

        def timed(*args: Any, _f: Any = original, _stage: str = stage, **kwargs: Any) -> Any:
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                return _f(*args, **kwargs)
            finally:
                entry = totals.setdefault(_stage, [0.0, 0.0])
                entry[0] += time.perf_counter() - wall
                entry[1] += time.thread_time() - cpu

        setattr(owner, name, functools.wraps(original)(timed))
    return os.getpid()


def take_timers(_host: Any) -> dict[str, list[float]]:
    """Run in an actor: the stage totals since the last call, reset."""
    import builtins

    totals: dict[str, list[float]] = builtins._refit_profile  # type: ignore[attr-defined]
    taken = {k: list(v) for k, v in totals.items()}
    totals.clear()
    return taken


def profile(model_dir: str, tp: int, repeats: int, verify: bool) -> dict[str, dict[str, dict[str, Any]]]:
    import ray

    from rl_vllm.generation import VllmGeneration
    from rlcore.config import load_config_dict
    from rlcore.distributed import RayVirtualCluster
    from rlcore.policy import Policy
    from rlcore.refit import DEFAULT_BUCKET_BYTES, WeightSynchronizer
    from rlcore.testing.models import build_tiny_tokenizer

    gen = {"backend": "vllm", "max_new_tokens": 8, "pad_token_id": 0}
    gen["vllm_cfg"] = {"kv_cache_space_gb": KV_CACHE_GB, "max_model_len": 128, "tensor_parallel_size": tp}
    policy_cfg = {"backend": "reference", "model_name": model_dir, "precision": "float32", "generation": gen}
    policy_cfg.update(train_global_batch_size=tp, train_micro_batch_size=1, max_total_sequence_length=64)
    cfg = load_config_dict({"cluster": {"workers_per_node": tp}, "policy": policy_cfg}).policy
    cluster = RayVirtualCluster([tp], max_colocated_worker_groups=2)
    policy = generation = None
    try:
        policy = Policy(cluster, cfg, build_tiny_tokenizer(), name_prefix="prof-tp", init_reference_model=False)
        generation = VllmGeneration(cluster, cfg.generation, name_prefix="prof-tp-vllm")
        actors = {f"training {r}": a for r, a in enumerate(policy.worker_group.workers)}
        actors.update({f"engine {r}": a for r, a in enumerate(generation.worker_group.workers)})
        pids = {rank: ray.get(actor.__ray_call__.remote(install_timers)) for rank, actor in actors.items()}
        syncs = {
            "colocated": WeightSynchronizer(policy, generation, colocated=True, verify=verify),
            "collective": WeightSynchronizer(policy, generation, colocated=False, cluster=cluster, verify=verify),
        }

        def floor() -> dict[str, float]:
            ray.get(generation.worker_group.run_all_workers_single_data("reload_floor", DEFAULT_BUCKET_BYTES).refs)
            return {}

        steps = {"floor": floor, **{k: sync.sync_weights for k, sync in syncs.items()}}
        for step in steps.values():
            step()  # warm-up (the engines record their regions in the first whole refit)
        for actor in actors.values():
            ray.get(actor.__ray_call__.remote(take_timers))
        rounds: dict[str, list[dict[str, dict[str, Any]]]] = {k: [] for k in steps}
        for _ in range(repeats):
            for name, step in steps.items():
                before = {rank: cpu_seconds(pid) for rank, pid in pids.items()}
                stats = step()
                row: dict[str, dict[str, Any]] = {"sent": {"bytes": stats.get("bytes", 0.0)}}
                for rank, actor in actors.items():
                    row[rank] = {"cpu_s": cpu_seconds(pids[rank]) - before[rank]}
                    row[rank].update(ray.get(actor.__ray_call__.remote(take_timers)))
                rounds[name].append(row)
    finally:
        for owner in (generation, policy):
            if owner is not None:
                owner.shutdown()
        cluster.shutdown()
    return {name: _medians(rows) for name, rows in rounds.items()}


def _medians(rows: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    out["sent"] = {"bytes": statistics.median(r["sent"]["bytes"] for r in rows)}
    for rank in (rank for rank in rows[0] if rank != "sent"):
        out[rank] = {"cpu_s": round(statistics.median(r[rank]["cpu_s"] for r in rows), 3)}
        for stage in sorted({s for r in rows for s in r[rank] if s != "cpu_s"}):
            got = [r[rank].get(stage, [0.0, 0.0]) for r in rows]
            out[rank][stage] = [round(statistics.median(g[i] for g in got), 3) for i in (0, 1)]
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--model-dir", help="a float32 HF model directory (default: refit.py's ~134M Llama)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--verify", action="store_true", help="verified refit (fingerprints compared)")
    args = parser.parse_args(argv)

    import torch

    from rlcore.distributed import shutdown_ray
    from rlcore.testing.models import tiny_model_path

    torch.set_num_threads(1)
    try:
        result = profile(args.model_dir or tiny_model_path(**MODEL), args.tp, args.repeats, args.verify)
    finally:
        shutdown_ray()
    print(f"load average {os.getloadavg()[0]:.1f}; per rank: process CPU s, then stage wall s / thread CPU s")
    for step, ranks in result.items():
        print(f"{step}: {ranks['sent']['bytes'] / 1e6:.1f} MB sent by the busiest training rank")
        for rank, stages in ((k, v) for k, v in ranks.items() if k != "sent"):
            parts = [f"{stage} {t[0]:.3f}/{t[1]:.3f}" for stage, t in stages.items() if stage != "cpu_s"]
            print(f"  {rank:<11} cpu {stages['cpu_s']:.3f}  " + "  ".join(parts))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
