"""Mixture-of-experts training on the megatron backend: step time and peak memory per rank at EP 1 and EP 2.

Two CPU ranks (dp 2 both times); EP 1 keeps every expert on both ranks, EP 2 keeps half on each and moves
tokens by all-to-all. One Qwen3-MoE model built locally (default: 4 layers, hidden 256, 16 experts of width 512,
top-2: 25.2M expert and 0.6M other parameters), Adam, NLL on random tokens, ``--steps`` timed steps after one
warm-up, median reported.

Memory theory per rank: (dense + experts / EP) parameters x 4 bytes x 5 copies (the float32 weights, their
gradient buffer, Adam's two moments, the reference model's CPU copy). The processes also hold Python, torch and
megatron themselves, which EP does not change, so the check is the *difference*: peak(EP 1) - peak(EP 2) against
experts / 2 x 4 bytes x 5.

    .venv/bin/python benchmarks/moe.py [--steps 5] [--experts 16] [--layers 4]

Prints one line per EP and the ratios, then JSON as the last line. The 1-minute load average is printed with each
result: other engineers share the 2 cores, and absolute times move with it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

COPIES = 5  # weights, gradient buffer, Adam m and v, the reference copy


def build_model(args: argparse.Namespace) -> str:
    from rlcore.models.cache import tiny_model_path

    return tiny_model_path(
        arch="qwen3_moe",
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        intermediate_size=4 * args.hidden,
        num_experts=args.experts,
        num_experts_per_tok=2,
        moe_intermediate_size=args.expert_width,
    )


def parameter_counts(model_dir: str) -> tuple[int, int]:
    """(expert parameters, all other parameters) of the checkpoint."""
    from safetensors import safe_open

    experts = other = 0
    with safe_open(os.path.join(model_dir, "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            n = 1
            for d in f.get_slice(name).get_shape():
                n *= d
            if ".mlp.experts." in name:
                experts += n
            else:
                other += n
    return experts, other


def batch(args: argparse.Namespace, vocab: int) -> Any:
    import torch

    from rlcore.data import BatchedDataDict

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (args.gbs, args.seq), generator=gen)
    ones = torch.ones(args.gbs, args.seq, dtype=torch.long)
    return BatchedDataDict(
        input_ids=ids,
        input_lengths=torch.full((args.gbs,), args.seq),
        token_mask=ones,
        sample_mask=torch.ones(args.gbs),
    )


def measure(model_dir: str, ep: int, args: argparse.Namespace) -> dict[str, Any]:
    from rlcore.algorithms.sft.loss import NLLLoss
    from rlcore.config import load_config_dict
    from rlcore.distributed import RayVirtualCluster
    from rlcore.policy import Policy
    from rlcore.testing.models import build_tiny_tokenizer

    policy_cfg = {
        "backend": "megatron",
        "model_name": model_dir,
        "train_global_batch_size": args.gbs,
        "train_micro_batch_size": args.mbs,
        "logprob_batch_size": args.mbs,
        "learning_rate": 1e-4,
        "max_grad_norm": 1.0,
        "precision": "float32",
        "max_total_sequence_length": args.seq,
        "dtensor_cfg": {"enabled": False},
        "megatron_cfg": {
            "enabled": True,
            "expert_model_parallel_size": ep,
            "optimizer": {"optimizer": "adam", "use_distributed_optimizer": False},
        },
    }
    cfg = load_config_dict({"cluster": {"workers_per_node": 2}, "policy": policy_cfg}).policy
    cluster = RayVirtualCluster([2])
    policy = Policy(cluster, cfg, build_tiny_tokenizer())
    try:
        data = batch(args, 300)
        times = []
        for step in range(args.steps + 1):
            t0 = time.perf_counter()
            result = policy.train(data, NLLLoss())
            if step:  # the first step warms up
                times.append(time.perf_counter() - t0)
        peaks = [p["rss"] for p in policy.worker_group.peak_memory()]
        aux = sum(result["all_mb_metrics"].get("moe_aux_loss", [0.0]))
    finally:
        policy.shutdown()
        cluster.shutdown()
    return {
        "ep": ep,
        "step_s_median": statistics.median(times),
        "step_s": times,
        "peak_rss_mib": [p / 2**20 for p in peaks],
        "aux_loss_last": aux,
        "load_1min": os.getloadavg()[0],
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--expert-width", type=int, default=512)
    ap.add_argument("--gbs", type=int, default=16)
    ap.add_argument("--mbs", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    from rlcore.distributed import init_ray, shutdown_ray

    args = parse_args(argv)
    model_dir = build_model(args)
    experts, other = parameter_counts(model_dir)
    init_ray(num_cpus=2)
    try:
        runs = {ep: measure(model_dir, ep, args) for ep in (1, 2)}
    finally:
        shutdown_ray()
    for ep, r in runs.items():
        theory = (other + experts / ep) * 4 * COPIES / 2**20
        print(
            f"EP {ep}: step {r['step_s_median']:.3f} s (median of {len(r['step_s'])}), peak RSS per rank "
            f"{', '.join(f'{m:.0f}' for m in r['peak_rss_mib'])} MiB (model state in theory {theory:.0f} MiB), "
            f"load {r['load_1min']:.1f}"
        )
    saved = max(runs[1]["peak_rss_mib"]) - max(runs[2]["peak_rss_mib"])
    saved_theory = experts / 2 * 4 * COPIES / 2**20
    time_ratio = runs[2]["step_s_median"] / runs[1]["step_s_median"]
    print(f"EP 2 / EP 1 step time: {time_ratio:.2f}x")
    print(
        f"peak RSS saved per rank by EP 2: {saved:.0f} MiB, theory {saved_theory:.0f} MiB ({saved / saved_theory:.2f}x)"
    )
    summary = {
        "expert_params": experts,
        "other_params": other,
        "step_time_ratio_ep2_over_ep1": round(time_ratio, 3),
        "rss_saved_mib": round(saved, 1),
        "rss_saved_theory_mib": round(saved_theory, 1),
        "runs": {str(ep): r for ep, r in runs.items()},
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
