"""First figures on a GPU: training MFU against a raw torch step, CUDA IPC refit against a device copy,
and peak GPU memory against theory.

For each model preset (shapes of Qwen2.5-0.5B and Llama-3.2-1B, random weights built locally from a
config, bf16 safetensors cached under ``$RLCORE_CACHE/bench-models``):

- **raw**: a plain torch script in its own process does the same optimizer step on the same tokens:
  the Hugging Face model with float32 weights under ``torch.autocast(bfloat16)``, token-mean NLL over
  the same micro-batches, ``clip_grad_norm_(1.0)``, ``torch.optim.AdamW``. No rlcore code.
- **dtensor** / **megatron**: ``Policy.train`` of a one-GPU policy (bf16: FSDP2 mixed precision with
  float32 master weights / megatron-core bf16 weights with float32 main weights; AdamW; clip 1.0),
  timed in the driver, so Ray dispatch and result gathering count.

One sequence length per preset: the longest of 8192/4096/2048/1024 whose estimated peak memory
(below) stays under 70% of the GPU for every backend run (``--seq`` overrides). megatron's local
layer spec (no TransformerEngine) materialises the S x S attention scores, which is usually what
limits it. Tokens per step: ``--tokens`` (at least one sequence), micro-batch 1.

Model FLOPs per step = ``6 * N * tokens + 12 * layers * d_attn * S * tokens`` (PaLM's convention:
N counts every distinct parameter, tied embeddings once, so the LM head matmul is in; attention
counted over the full S x S, no causal discount). MFU = FLOPs / (median step time * the GPU's dense
bf16 peak: H100 SXM / H200 989.4 TFLOP/s, H100 PCIe 756; unknown GPUs get no MFU).

Memory theory: static ``16 * N`` bytes (float32 weights, gradients and two Adam moments; megatron:
bf16 weights and gradients plus float32 main weights and moments, also 16 bytes), plus activations
``34 * S * b * hidden`` bytes per layer (Korthikanti et al. 2022, bf16, flash attention), plus
``8 * heads * S^2 * b`` per layer for megatron's unfused attention, plus ``10 * b * S * vocab`` for
the logits (bf16, their float32 copy and its gradient). Measured: ``torch.cuda.max_memory_allocated``
in the training process over the timed steps.

Refit: after its steps, each policy refits its bf16 weights into a receiver in another process on
the same GPU (a Ray actor sharing the bundle) through ``WeightSynchronizer`` (colocated: CUDA IPC
buffers, default 64 MiB buckets; the receiver copies each tensor into preallocated engine-like
tensors). One warm-up, median of 3, timed in the driver. Baseline: a device-to-device copy of the
same bytes in the receiver's process (CUDA events, median of 5 after one warm-up). GB/s count the payload once.

    python benchmarks/gpu.py [--presets 0.5b,1b] [--backends dtensor,dtensor-regather,megatron] [--seq S]
                             [--tokens 16384] [--steps 5] [--warmup 2] [--budget-s 1800] [--profile DIR]
                             [--dtensor-cfg '{"reshard_after_forward": true}']

``dtensor-regather`` is the dtensor backend with FSDP2's per-micro-batch schedule (``reshard_after_forward:
true``, ``reduce_grads: per_micro_batch``), beside ``dtensor`` with its defaults (issue 41).

``--profile DIR``: one more step of each side under the torch profiler, summed by kernel
(:mod:`gpu_profile`), printed after the tables and kept in the JSON.

Without CUDA it prints one line and exits 0. The last line printed is JSON.

This file is the command line, the driver and the tables; beside it, one job each: ``gpu_shapes`` (the
presets, FLOPs, memory theory and data), ``gpu_raw`` (the model build and the raw torch step, run here as
subprocess modes), ``gpu_policy`` (the rlcore sides), ``gpu_refit_sink`` (the refit receiver and its timing)
and ``gpu_profile`` (the profiler summaries).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import gpu_profile
from gpu_policy import DTENSOR_SIDES, run_policy
from gpu_raw import prepare, raw_step
from gpu_refit_sink import SinkGroup
from gpu_shapes import PRESETS, memory_theory, model_flops, peak_tflops, pick_seq, shape_of

HERE = Path(__file__).resolve().parent
#: Rough seconds each unit of work needs, to skip what the time budget cannot hold.
COST_S = {"prepare": 30, "raw": 35, "dtensor": 60, "dtensor-regather": 60, "megatron": 80}


def run_subprocess(args: list[str], timeout_s: float) -> dict:
    """Run this script in a fresh process in one of its modes; its last stdout line is JSON."""
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), *args],
        capture_output=True,
        text=True,
        timeout=max(10.0, timeout_s),
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-6:]
        raise RuntimeError(f"{args[0]} failed (exit {proc.returncode}): " + " | ".join(tail))
    return json.loads(lines[-1])


# --------------------------------------------------------------------------- main


def _round(x: Any, n: int = 4) -> Any:
    return round(x, n) if isinstance(x, float) else x


def summarize(side: dict, flops: float, peak: float | None, raw_s: float | None, theory: dict | None) -> dict:
    if "step_s" not in side:
        return side
    out = {
        "step_s": _round(side["step_s"]),
        "tflops": _round(flops / side["step_s"] / 1e12, 1),
        "mfu": _round(flops / side["step_s"] / (peak * 1e12), 3) if peak else None,
        "peak_gb": _round(side["peak_bytes"] / 1e9, 2),
        "loss": _round(side["losses"][-1]),
    }
    if raw_s:
        out["vs_raw"] = _round(side["step_s"] / raw_s, 3)
    if theory:
        out["theory_gb"] = _round(theory["total"] / 1e9, 2)
        out["theory_static_gb"] = _round(theory["static"] / 1e9, 2)
        out["peak_vs_theory"] = _round(side["peak_bytes"] / theory["total"], 2)
    for key in ("profile", "refit_error"):
        if key in side:
            out[key] = side[key]
    if "refit" in side:
        r = side["refit"]
        out["refit"] = {
            "bytes": r["bytes"],
            "refit_s": _round(r["refit_s"]),
            "refit_gb_s": _round(r["refit_gb_s"], 1),
            "d2d_gb_s": _round(r["d2d_gb_s"], 1),
            "refit_vs_d2d": _round(r["ratio"], 1),
        }
    return out


def _importable(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # the parent package is missing
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default="0.5b,1b")
    parser.add_argument(
        "--backends",
        default="dtensor,dtensor-regather,megatron",
        help="of dtensor, dtensor-regather (FSDP2's per-micro-batch schedule), megatron",
    )
    parser.add_argument(
        "--dtensor-cfg",
        type=json.loads,
        default={},
        metavar="JSON",
        help="policy.dtensor_cfg settings for the dtensor rows, over each row's own",
    )
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default: the longest that fits)")
    parser.add_argument("--tokens", type=int, default=16384, help="tokens per optimizer step")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--budget-s", type=float, default=1800.0, help="skip what would not finish in this time")
    parser.add_argument("--no-refit", action="store_true")
    parser.add_argument("--profile", metavar="DIR", help="profile one more step of each side; traces go to DIR")
    # Internal modes (the script runs itself in fresh processes).
    parser.add_argument("--prepare", metavar="PRESET", help=argparse.SUPPRESS)
    parser.add_argument("--raw", nargs=6, metavar="X", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.prepare:
        print(json.dumps(prepare(args.prepare)))
        return 0
    if args.raw:
        path, *numbers = args.raw
        print(json.dumps(raw_step(path, *map(int, numbers))))
        return 0

    deadline = time.monotonic() + args.budget_s
    if args.profile:  # before Ray starts: its workers inherit the variable
        Path(args.profile).mkdir(parents=True, exist_ok=True)
        os.environ["RLCORE_PROFILE_DIR"] = str(Path(args.profile).resolve())
    import torch

    if not torch.cuda.is_available():
        print(f"benchmarks/gpu.py: no CUDA device (torch {torch.__version__}): nothing to measure")
        print(json.dumps({"skipped": "no CUDA device"}))
        return 0
    presets = [p for p in args.presets.split(",") if p]
    backends = [b for b in args.backends.split(",") if b]
    unknown = [p for p in presets if p not in PRESETS] + [b for b in backends if b not in COST_S or b == "raw"]
    if unknown:
        backends = sorted(set(COST_S) - {"prepare", "raw"})
        parser.error(f"unknown presets/backends {unknown}; presets: {sorted(PRESETS)}, backends: {backends}")
    missing: dict[str, str] = {}
    if not _importable("ray"):
        missing.update({b: "Ray is not installed" for b in backends})
    if "megatron" in backends and not _importable("megatron.core"):
        missing.setdefault("megatron", "megatron-core is not installed")
    for backend, why in missing.items():
        print(f"{why}: the {backend} rows are skipped", file=sys.stderr)
    backends = [b for b in backends if b not in missing]

    def left() -> float:
        return deadline - time.monotonic()

    results: dict[str, Any] = {"presets": {}, "gpu": None, "peak_bf16_tflops": None}
    os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])])
    cluster = None
    try:
        for preset in presets:
            entry: dict[str, Any] = results["presets"].setdefault(preset, {})
            entry.update({backend: {"skipped": why} for backend, why in missing.items()})
            if left() < COST_S["prepare"] + COST_S["raw"]:
                entry["skipped"] = "time budget"
                continue
            try:
                prep = run_subprocess(["--prepare", preset], left())
            except Exception as exc:  # noqa: BLE001 - the next preset may still run
                entry["error"] = str(exc)[:300]
                continue
            gpu = prep["gpu"]
            results.update(gpu=gpu["name"], peak_bf16_tflops=peak_tflops(gpu["name"]), torch=prep["torch"])
            shape, n_params = shape_of(preset), prep["params"]
            seq = args.seq or pick_seq(backends, n_params, shape, gpu["total_bytes"])
            batch = max(1, args.tokens // seq)
            tokens = batch * (seq - 1)  # trained tokens: every position but the first of each row
            flops = model_flops(n_params, shape, seq, batch * seq)
            entry.update(
                params=n_params,
                seq=seq,
                batch=batch,
                micro_batch=1,
                tokens_per_step=batch * seq,
                trained_tokens_per_step=tokens,
                model_tflop_per_step=_round(flops / 1e12, 2),
            )
            print(
                f"[{preset}] {n_params / 1e9:.3f}B params, S={seq}, {batch} x {seq} tokens/step, "
                f"{flops / 1e12:.1f} TFLOP/step",
                file=sys.stderr,
                flush=True,
            )
            peak = results["peak_bf16_tflops"]
            raw_s = None
            try:
                raw = run_subprocess(
                    ["--raw", prep["path"], str(seq), str(batch), "1", str(args.steps), str(args.warmup)], left()
                )
                raw_s = raw["step_s"]
                entry["raw"] = summarize(raw, flops, peak, None, memory_theory("raw", n_params, shape, seq, 1))
            except Exception as exc:  # noqa: BLE001 - reported in the table, the other rows still run
                entry["raw"] = {"error": str(exc)[:300]}
            print(f"[{preset}] raw: {entry['raw']}", file=sys.stderr, flush=True)
            print(json.dumps(results), file=sys.stderr, flush=True)
            if cluster is None:
                from rlcore.distributed import RayVirtualCluster

                cluster = RayVirtualCluster([1], use_gpus=True, max_colocated_worker_groups=2, name="bench-gpu")
            sink = None
            try:
                for backend in backends:
                    if left() < COST_S[backend]:
                        entry[backend] = {"skipped": "time budget"}
                        continue
                    if sink is None and not args.no_refit:
                        sink = SinkGroup(cluster)
                    try:
                        side = run_policy(
                            cluster,
                            backend,
                            prep["path"],
                            shape["vocab"],
                            seq,
                            batch,
                            1,
                            args.steps,
                            args.warmup,
                            sink,
                            args.dtensor_cfg,
                        )
                        entry[backend] = summarize(
                            side, flops, peak, raw_s, memory_theory(backend, n_params, shape, seq, 1)
                        )
                    except Exception as exc:  # noqa: BLE001
                        entry[backend] = {"error": str(exc)[:300]}
                    print(f"[{preset}] {backend}: {entry[backend]}", file=sys.stderr, flush=True)
                    print(json.dumps(results), file=sys.stderr, flush=True)  # the result so far, if stopped
            finally:
                if sink is not None:
                    sink.shutdown()
    finally:
        if cluster is not None:
            cluster.shutdown()

    print_tables(results)
    profiles = {
        f"{preset} {side}": row["profile"]
        for preset, entry in results["presets"].items()
        for side, row in entry.items()
        if isinstance(row, dict) and "profile" in row
    }
    gpu_profile.print_profiles(profiles, sys.stdout)
    print(json.dumps(results))
    return 0


def print_tables(results: dict) -> None:
    print(
        f"GPU: {results.get('gpu')}, dense bf16 peak {results.get('peak_bf16_tflops')} TFLOP/s, "
        f"torch {results.get('torch')}"
    )
    header = (
        f"{'preset':<7}{'S':>6}{'tok/step':>9} {'side':<17}{'step s':>8}{'TFLOP/s':>9}{'MFU':>7}{'vs raw':>8}"
        f"{'peak GB':>9}{'theory GB':>10}"
    )
    print(header)
    for preset, entry in results["presets"].items():
        for side in ("raw", *DTENSOR_SIDES, "megatron"):
            row = entry.get(side)
            if row is None:
                continue
            if "step_s" not in row:
                print(
                    f"{preset:<7}{entry.get('seq', ''):>6}{entry.get('tokens_per_step', ''):>9} {side:<17}"
                    f"{row.get('error') or row.get('skipped')}"
                )
                continue
            mfu = f"{row['mfu']:.3f}" if row.get("mfu") is not None else "-"
            print(
                f"{preset:<7}{entry['seq']:>6}{entry['tokens_per_step']:>9} {side:<17}{row['step_s']:>8.3f}"
                f"{row['tflops']:>9.1f}{mfu:>7}{row.get('vs_raw', 1.0):>8.3f}{row['peak_gb']:>9.2f}"
                f"{row.get('theory_gb', math.nan):>10.2f}"
            )
    print(f"{'preset':<7} {'refit from':<17}{'GB':>7}{'refit s':>9}{'GB/s':>8}{'d2d GB/s':>10}{'x d2d':>7}")
    for preset, entry in results["presets"].items():
        for side in (*DTENSOR_SIDES, "megatron"):
            r = (entry.get(side) or {}).get("refit")
            if r:
                print(
                    f"{preset:<7} {side:<17}{r['bytes'] / 1e9:>7.2f}{r['refit_s']:>9.4f}{r['refit_gb_s']:>8.1f}"
                    f"{r['d2d_gb_s']:>10.1f}{r['refit_vs_d2d']:>7.1f}"
                )


if __name__ == "__main__":
    sys.exit(main())
