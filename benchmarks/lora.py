"""LoRA against full fine-tuning, same model and batch (issue 16): memory, step time, refit bytes.

For each mode (``full``, then ``lora``), in fresh worker processes: a dp=2
dtensor policy (AdamW, reference model on, as GRPO runs it) trains; then a
policy without optimizer and two vLLM engines colocated with it refit. Measured:

- trainable parameters (counted on the meta device, adapters applied as the worker applies them);
- memory of the largest training rank: ``train_peak_gb``, the peak resident memory during the
  timed steps (``VmHWM`` reset after the warm-up step through ``/proc/<pid>/clear_refs``: weights,
  gradients, optimizer state, reference model, activations; what a GPU's peak allocation would
  count), and ``peak_rss_gb``, the process's peak since it started (includes loading the checkpoint);
- train step time (``Policy.train``, NLL, median of ``--repeats`` after one warm-up step);
- refit: the first refit (the whole model, both modes) and the one after a step: for LoRA only
  the adapted layers, merged (W + (alpha/dim) BA), the q/k/v and gate/up groups whole; bytes
  and seconds; and an adapter refit (``policy.lora.refit: adapter``: the PEFT adapter directory the
  engines load as a LoRA module), bytes written and seconds.

    python benchmarks/lora.py                      # the 0.5B preset (qwen2.5-0.5b), all linear layers
    python benchmarks/lora.py --targets q_proj,v_proj
    python benchmarks/lora.py --preset-layers 2    # the 0.5B shape cut to 2 layers (a quick run)
    python benchmarks/lora.py --precision float32  # float32 compute and refit (default bfloat16)

The last line printed is JSON: ``memory_vs_full`` (of ``train_peak_gb``), ``refit_bytes_vs_full``,
``step_time_vs_full``,
``trainable_params`` and the per-mode figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from scaling import count_params, ray_session, status_kb  # noqa: E402  (the sibling benchmark's helpers)

WORLD = 2
GB = 1e9


def lora_settings(targets: str, dim: int) -> dict:
    base = {"enabled": True, "dim": dim, "alpha": 2 * dim, "lora_A_init": "uniform"}
    if targets == "all":
        return {**base, "match_all_linear": True}
    return {**base, "match_all_linear": False, "target_modules": targets.split(",")}


def trainable_params(model_dir: str, lora: dict | None) -> int:
    """Parameters the optimizer sees: all of them, or the adapters (built on the meta device)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlcore.config.policy import LoRAConfig
    from rlcore.training.lora import apply_lora

    if lora is None:
        return count_params(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
        apply_lora(model, LoRAConfig(**lora))
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def config(model_dir: str, lora: dict | None, seq_len: int, pad_id: int, precision: str) -> Any:
    from rlcore.config import load_config_dict

    policy = {
        "backend": "dtensor",
        "model_name": model_dir,
        "precision": precision,
        "train_global_batch_size": 2 * WORLD,
        "train_micro_batch_size": 1,
        "logprob_batch_size": 1,
        "max_total_sequence_length": seq_len,
        "learning_rate": 1e-5,
        "max_grad_norm": 1.0,
        "generation": {
            "backend": "vllm",
            "max_new_tokens": 8,
            "pad_token_id": pad_id,
            "vllm_cfg": {"kv_cache_space_gb": 0.25, "max_model_len": seq_len, "precision": precision},
        },
    }
    if lora is not None:
        policy["lora"] = lora
    return load_config_dict({"cluster": {"workers_per_node": WORLD}, "policy": policy}).policy


def run_mode(model_dir: str, lora: dict | None, args: argparse.Namespace, tokenizer: Any) -> dict:
    """Training (memory, step time) and refit (bytes, seconds) of one mode, in two rounds of fresh workers:
    the engines are not up while the policy trains, so the 0.5B preset fits in 24 GB."""
    figures = {
        "trainable_params": trainable_params(model_dir, lora),
        **train_figures(model_dir, lora, args, tokenizer),
        **refit_figures(model_dir, lora, args, tokenizer),
    }
    if lora is not None:
        adapter = refit_figures(model_dir, {**lora, "refit": "adapter"}, args, tokenizer)
        figures.update(adapter_refit_bytes=adapter["refit_bytes"], adapter_refit_s=adapter["refit_s"])
    return figures


def train_figures(model_dir: str, lora: dict | None, args: argparse.Namespace, tokenizer: Any) -> dict:
    """A dp=2 policy (AdamW, reference model on, as GRPO runs it): peak memory and time of the steps."""
    from rlcore.algorithms.sft.loss import NLLLoss
    from rlcore.data import BatchedDataDict
    from rlcore.distributed import RayVirtualCluster
    from rlcore.policy import Policy
    from rlcore.testing.models import make_batch

    cfg = config(model_dir, lora, args.seq_len, tokenizer.pad_token_id, args.precision)
    batch = BatchedDataDict(make_batch(tokenizer, 2 * WORLD, args.seq_len // 2, args.seq_len - 1, seed=0))
    cluster = RayVirtualCluster([WORLD])
    policy = None
    try:
        policy = Policy(cluster, cfg, tokenizer, name_prefix="bench-lora")
        policy.train(batch, NLLLoss())  # warm-up (allocates the optimizer state)
        pids = policy.worker_group.worker_pids()
        for pid in pids:
            with open(f"/proc/{pid}/clear_refs", "w") as f:
                f.write("5")  # VmHWM := VmRSS: the peak from here on is the training steps'
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            policy.train(batch, NLLLoss())
            times.append(time.perf_counter() - start)
        train_peak = max(status_kb(pid, "VmHWM") for pid in pids)
        peak = (
            max(
                info["max_rss_mb"]
                for info in policy.worker_group.get_results(
                    policy.worker_group.run_all_workers_single_data("get_gpu_info")
                )
            )
            * 2**20
        )
    finally:
        if policy is not None:
            policy.shutdown()
        cluster.shutdown()
    return {
        "train_peak_gb": train_peak / GB,
        "peak_rss_gb": peak / GB,
        "step_s": statistics.median(times),
        "step_s_all": times,
    }


def refit_figures(model_dir: str, lora: dict | None, args: argparse.Namespace, tokenizer: Any) -> dict:
    """The policy (no optimizer) and two colocated vLLM engines: the first refit (the whole model) and the
    next one (LoRA: the adapted layers only, whatever their values; with ``refit: adapter`` the adapters
    alone, to engines running them as LoRA modules)."""
    from rl_vllm.generation import VllmGeneration
    from rlcore.distributed import RayVirtualCluster
    from rlcore.policy import Policy
    from rlcore.refit import WeightSynchronizer

    cfg = config(model_dir, lora, args.seq_len, tokenizer.pad_token_id, args.precision)
    cluster = RayVirtualCluster([WORLD], max_colocated_worker_groups=2)
    policy = generation = None
    try:
        policy = Policy(
            cluster, cfg, tokenizer, name_prefix="bench-lora-refit", init_optimizer=False, init_reference_model=False
        )
        adapter = lora is not None and lora.get("refit") == "adapter"
        generation = VllmGeneration(
            cluster, cfg.generation, name_prefix="bench-lora-vllm", **({"lora_rank": lora["dim"]} if adapter else {})
        )
        sync = WeightSynchronizer(policy, generation, colocated=True, partial_refit=True, adapter_refit=adapter)
        first = sync.sync_weights()
        after = sync.sync_weights()
        sync.shutdown()
    finally:
        for owner in (generation, policy):
            if owner is not None:
                owner.shutdown()
        cluster.shutdown()
    return {
        "first_refit_bytes": first["bytes"],
        "first_refit_s": first["seconds"],
        "refit_bytes": after["bytes"],
        "refit_s": after["seconds"],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen2.5-0.5b")
    parser.add_argument("--preset-layers", type=int, default=None, help="cut the preset to this many layers")
    parser.add_argument("--targets", default="all", help="'all' (every linear layer) or e.g. q_proj,v_proj")
    parser.add_argument("--dim", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--precision",
        default="bfloat16",
        choices=["float32", "bfloat16"],
        help="compute dtype of training (float32 master weights either way) and of the engines",
    )
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    from rlcore.models import tiny_model_path
    from rlcore.models.presets import preset

    overrides = {"num_layers": args.preset_layers} if args.preset_layers else {}
    model_dir = tiny_model_path(**preset(args.preset, **overrides))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    lora = lora_settings(args.targets, args.dim)
    load = os.getloadavg()[0]
    with ray_session(WORLD):
        results = {
            "full": run_mode(model_dir, None, args, tokenizer),
            "lora": run_mode(model_dir, lora, args, tokenizer),
        }
    full, ours = results["full"], results["lora"]
    print(
        f"{args.preset}{f' ({args.preset_layers} layers)' if args.preset_layers else ''}: "
        f"{count_params(model_dir) / 1e6:.0f}M params, LoRA r={args.dim} on {args.targets}, "
        f"seq {args.seq_len}, dp={WORLD}, {args.precision}, load {load:.1f}"
    )
    print(
        f"{'':8}{'trainable':>12}{'train GB/rank':>15}{'peak GB/rank':>14}{'step s':>9}{'refit MB':>10}{'refit s':>9}"
    )
    for mode, r in results.items():
        print(
            f"{mode:8}{r['trainable_params'] / 1e6:>11.2f}M{r['train_peak_gb']:>15.2f}{r['peak_rss_gb']:>14.2f}"
            f"{r['step_s']:>9.2f}{r['refit_bytes'] / 1e6:>10.1f}{r['refit_s']:>9.2f}"
        )
    print(
        f"{'adapter':8}{'':>12}{'':>15}{'':>14}{'':>9}{ours['adapter_refit_bytes'] / 1e6:>10.1f}"
        f"{ours['adapter_refit_s']:>9.2f}   (lora, refit: adapter)"
    )
    summary = {
        "preset": args.preset,
        "layers": args.preset_layers,
        "targets": args.targets,
        "dim": args.dim,
        "seq_len": args.seq_len,
        "precision": args.precision,
        "load": load,
        "trainable_params": ours["trainable_params"],
        "memory_vs_full": ours["train_peak_gb"] / full["train_peak_gb"],
        "peak_rss_vs_full": ours["peak_rss_gb"] / full["peak_rss_gb"],
        "refit_bytes_vs_full": ours["refit_bytes"] / full["refit_bytes"],
        "refit_seconds_vs_full": ours["refit_s"] / full["refit_s"],
        "adapter_refit_bytes_vs_full": ours["adapter_refit_bytes"] / full["refit_bytes"],
        "adapter_refit_seconds_vs_full": ours["adapter_refit_s"] / full["refit_s"],
        "step_time_vs_full": ours["step_s"] / full["step_s"],
        "modes": results,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
