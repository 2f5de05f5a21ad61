"""What does rlcore's SFT step cost, compared with a raw torch loop of the same step?

The same steps are timed twice, on the same batches in the same order:

- **rlcore**: whole ``rlcore.algorithms.sft.loop.sft_step(run)`` calls on a run that
  ``rlcore.run.build.build_run`` started from ``examples/sft_tiny.yaml``
  (its chat data, batch of 32, micro-batch 8, length 96, lr 3e-3) with the
  ``dtensor`` backend on ``--world-size`` ranks, timed in the driver: drawing
  the next batch of samples, encoding it (loss on the assistant's tokens),
  ``prepare_for_training`` / ``train`` (NLL) / ``finish_training``, the peak
  memory query: everything the SFT loop does per step but validation and
  checkpoints;
- **raw**: ``policy_overhead.py``'s raw script (its ``RawRunner``/``_raw_rank``
  are imported): ``--world-size`` processes over gloo, the model sharded with
  plain torch FSDP2 (``fully_shard`` per decoder layer and the root), trained
  on the same encoded batches (``sft_batch`` of ``run.data.train.batch(k)``,
  the samples the run draws at step ``k``), the same per-rank rows, the same
  micro-batches (each cut to its longest row), the same loss normalisation,
  grad norm and optimizer (``--optimizer``, same lr), timed on rank 0 between
  barriers. The batch reaches the ranks before the clock starts: encoding is
  rlcore's cost only.

The config departs from ``sft_tiny.yaml`` only where the raw side needs it:
sequence packing off (an SFT run packs by default on dtensor; the raw step
trains padded micro-batches), no gradient clipping (the raw step computes the
grad norm but does not clip), and ``policy.model_name`` the model's directory.
Both sides run one torch thread per rank. Models (``--model``): ``tiny``
(tiny-llama, 0.4M parameters) or ``50m`` (the ~50M-parameter Llama of
``grpo_vs_trl.py``'s ``shaped`` case: hidden 768, 8 layers, built from a
config, random weights).

Both sides are started and warmed up with one step, then their steps are
interleaved (raw, rlcore, raw, ...) so that load from other processes on the
machine hits both alike; medians over ``--repeats`` are reported. Beside the
wall time, each side's CPU seconds per step are counted from ``/proc`` (user +
system, every thread): the ranks', plus for rlcore the driver's (encoding,
sharding, Ray's client). They move much less than wall time when other
processes crowd the machine. The warm-up step's loss is printed from both sides (same weights, same batch: it must be
equal) and so is the last step's (same updates since: close).

    python benchmarks/sft_step.py [--model tiny|50m] [--world-size 2] [--repeats 7] [--optimizer adamw|sgd]

The last line printed is JSON: ``{"rlcore_step_s", "raw_step_s", "ratio",
"rlcore_data_s", "rlcore_train_s", "rlcore_cpu_s", "raw_cpu_s", "cpu_ratio",
"model", "model_params", "world_size", "optimizer", "first_loss", "load"}``
(seconds of one step, medians; ratio = rlcore / raw wall time, goal <= 1.10;
``rlcore_data_s`` / ``rlcore_train_s`` are ``sft_step``'s own phase times;
``*_cpu_s`` CPU seconds of one step; ``first_loss`` is [rlcore, raw]; ``load``
the 1-minute load average [before, after]).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import policy_overhead as po  # noqa: E402  (the sibling benchmark whose raw script this reuses)

EXAMPLE = Path(__file__).resolve().parents[1] / "src" / "rlcore" / "examples" / "sft_tiny.yaml"
MODELS: dict[str, Any] = {
    "tiny": "tiny-llama",
    # grpo_vs_trl.py's ``shaped`` model: ~50M parameters
    "50m": dict(arch="llama", hidden_size=768, num_layers=8, num_heads=12, num_kv_heads=4, head_dim=64,
                intermediate_size=2048, max_position_embeddings=512),
}
OPTIMIZERS = {"adamw": "torch.optim.AdamW", "sgd": "torch.optim.SGD"}


def model_dir_for(name: str) -> tuple[str, int]:
    """Build (once, cached) the model; returns its directory and parameter count."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlcore.models import BUILTIN_MODELS, tiny_model_path

    spec = MODELS[name]
    path = tiny_model_path(**(BUILTIN_MODELS[spec] if isinstance(spec, str) else spec))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    return path, sum(p.numel() for p in model.parameters())


def sft_config(model_dir: str, world_size: int, optimizer: str) -> Any:
    """``sft_tiny.yaml``, changed only where the raw step needs it (see the module docstring)."""
    from rlcore.config import load_config, resolve

    cfg = load_config(EXAMPLE, [
        f"cluster.workers_per_node={world_size}", f"policy.model_name={model_dir}",
        f"policy.optimizer.name={OPTIMIZERS[optimizer]}", "policy.sequence_packing.enabled=false",
        "policy.max_grad_norm=null", "policy.precision=float32", "checkpointing.enabled=false",
    ])
    return resolve(cfg, run=True)


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds the processes have used so far (all their threads)."""
    ticks = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # fields 3.. of proc(5); utime and stime are 14, 15
        ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def driver_cpu_seconds() -> float:
    """This process's user + system CPU seconds (encoding, sharding, Ray's client threads)."""
    t = os.times()
    return t.user + t.system


# --------------------------------------------------------------------------- raw side


def _sft_raw_rank(settings: dict, rank: int, *args: Any) -> None:
    """policy_overhead's raw rank with this run's micro-batch, lr and optimizer."""
    import torch

    po.MICRO_BATCH, po.LR = settings["micro_batch"], settings["lr"]
    if settings["optimizer"] == "adamw":
        torch.optim.SGD = torch.optim.AdamW  # this process only: the raw rank builds SGD(params, lr=LR)
    po._raw_rank(rank, *args)


def start_raw(model_dir: str, world_size: int, settings: dict) -> po.RawRunner:
    """policy_overhead.RawRunner (FSDP2), its ranks running :func:`_sft_raw_rank`."""
    with mock.patch.object(po, "_raw_rank", functools.partial(_sft_raw_rank, settings)):
        return po.RawRunner(model_dir, world_size, fsdp2=True)


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adamw")
    args = parser.parse_args(argv)

    import transformers

    from rlcore.distributed import shutdown_ray
    from rlcore.run.build import build_run
    from rlcore.algorithms.sft.loop import sft_step
    from rlcore.algorithms.sft.batches import sft_batch

    transformers.utils.logging.disable_progress_bar()
    load_before = os.getloadavg()[0]
    model_dir, n_params = model_dir_for(args.model)
    resolved = sft_config(model_dir, args.world_size, args.optimizer)
    policy = resolved.config.policy
    print(f"model {args.model} ({n_params / 1e6:.2f}M params), {EXAMPLE.name}: batch {policy.train_global_batch_size}"
          f", micro-batch {policy.train_micro_batch_size}, <= {policy.max_total_sequence_length} tokens, "
          f"{args.optimizer} lr {policy.learning_rate}; dtensor dp={args.world_size} vs raw FSDP2, "
          f"{args.repeats} repeats after 1 warm-up; load {load_before:.1f}", file=sys.stderr)

    settings = {"micro_batch": policy.train_micro_batch_size, "lr": policy.learning_rate,
                "optimizer": args.optimizer}
    times: dict[str, list[float]] = {"raw": [], "rlcore": [], "data": [], "train": [], "raw_cpu": [],
                                     "rlcore_cpu": []}
    losses: dict[str, list[float]] = {"raw": [], "rlcore": []}
    raw = start_raw(model_dir, args.world_size, settings)
    try:
        run = build_run(resolved)
        try:
            raw_pids, worker_pids = list(raw.context.pids()), run.policy.worker_group.worker_pids()

            def raw_step() -> None:
                k = len(losses["raw"])  # the raw side's next batch: the one the run draws at its step k
                batch = sft_batch(run.data.train.batch(k), run.tokenizer, run.cfg)
                cpu = cpu_seconds(raw_pids)
                seconds, loss = raw.run(("train", {key: batch[key] for key in
                                                   ("input_ids", "input_lengths", "token_mask", "sample_mask")}))
                times["raw_cpu"].append(cpu_seconds(raw_pids) - cpu)
                times["raw"].append(seconds)
                losses["raw"].append(loss)

            def rlcore_step() -> None:
                cpu = cpu_seconds(worker_pids) + driver_cpu_seconds()
                t0 = time.perf_counter()
                metrics = sft_step(run)
                times["rlcore"].append(time.perf_counter() - t0)
                times["rlcore_cpu"].append(cpu_seconds(worker_pids) + driver_cpu_seconds() - cpu)
                losses["rlcore"].append(metrics["loss"])
                times["data"].append(metrics["time/data_s"])
                times["train"].append(metrics["time/train_s"])

            raw_step(), rlcore_step()  # warm-up
            for values in times.values():
                values.clear()
            for _ in range(args.repeats):
                raw_step()
                rlcore_step()
            assert run.next_batch == len(losses["raw"]), "both sides trained on the same batches"
        finally:
            run.shutdown()
    finally:
        raw.close()
        shutdown_ray()
    load_after = os.getloadavg()[0]

    med = {key: statistics.median(values) for key, values in times.items()}
    ratio, cpu_ratio = med["rlcore"] / med["raw"], med["rlcore_cpu"] / med["raw_cpu"]
    print(f"warm-up step loss: rlcore {losses['rlcore'][0]:.6f}, raw {losses['raw'][0]:.6f}; "
          f"last step: rlcore {losses['rlcore'][-1]:.6f}, raw {losses['raw'][-1]:.6f}")
    print(f"{'median seconds':<26}{'rlcore':>10}{'raw':>10}{'ratio':>8}")
    print(f"{'SFT step':<26}{med['rlcore']:>10.3f}{med['raw']:>10.3f}{ratio:>8.3f}")
    print(f"{'  of which data (encode)':<26}{med['data']:>10.3f}")
    print(f"{'  of which train':<26}{med['train']:>10.3f}")
    print(f"{'CPU s (ranks + driver)':<26}{med['rlcore_cpu']:>10.3f}{med['raw_cpu']:>10.3f}{cpu_ratio:>8.3f}")
    print(f"steps (s): rlcore {[round(t, 3) for t in times['rlcore']]}, raw {[round(t, 3) for t in times['raw']]}")
    print(f"load average {load_before:.1f} -> {load_after:.1f}")
    print(json.dumps({"rlcore_step_s": round(med["rlcore"], 4), "raw_step_s": round(med["raw"], 4),
                      "ratio": round(ratio, 4), "rlcore_data_s": round(med["data"], 4),
                      "rlcore_train_s": round(med["train"], 4), "rlcore_cpu_s": round(med["rlcore_cpu"], 3),
                      "raw_cpu_s": round(med["raw_cpu"], 3), "cpu_ratio": round(cpu_ratio, 4), "model": args.model,
                      "model_params": n_params, "world_size": args.world_size, "optimizer": args.optimizer,
                      "first_loss": [round(losses["rlcore"][0], 6), round(losses["raw"][0], 6)],
                      "load": [round(load_before, 2), round(load_after, 2)]}))


if __name__ == "__main__":
    main()
