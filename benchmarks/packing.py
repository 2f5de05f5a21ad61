"""Sequence packing vs padded batches: training tokens/s on a long-tail length distribution.

The same global batch (lengths drawn from a log-normal with a long tail, fixed
seed) is trained through a 2-rank ``Policy`` of a packing-capable backend
(default ``dtensor``) twice per repeat, interleaved so machine load hits both:

- **padded**: fixed micro-batches of ``--micro-batch`` sequences, each padded
  to its longest sequence (what plain batching computes on);
- **packed**: ``policy.sequence_packing`` on, micro-batches of at most
  ``--capacity`` tokens built by modified first-fit-decreasing.

Reported: useful (non-padding) training tokens per second of each (median over
``--repeats``) and the padding waste of each plan (1 - useful tokens /
computed tokens). The last line printed is JSON:
``{"padded_tok_s", "packed_tok_s", "speedup", "padded_waste", "packed_waste"}``.

    python benchmarks/packing.py [--backend dtensor] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time


def long_tail_lengths(n: int, max_len: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [max(8, min(max_len, int(rng.lognormvariate(4.0, 0.9)))) for _ in range(n)]


def make_data(lengths: list[int], vocab: int, seed: int):
    import torch

    from rlcore.data import BatchedDataDict

    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(3, vocab, (len(lengths), width), generator=g)
    lens = torch.tensor(lengths)
    positions = torch.arange(width)
    ids = ids * (positions[None] < lens[:, None])
    token_mask = ((positions[None] >= 1) & (positions[None] < lens[:, None])).float()
    return BatchedDataDict(
        input_ids=ids, input_lengths=lens, token_mask=token_mask, sample_mask=torch.ones(len(lengths))
    )


def padded_waste(lengths: list[int], dp: int, mbs: int) -> float:
    """Padding fraction of plain micro-batching: each rank's micro-batch padded to its longest row."""
    per_rank = len(lengths) // dp
    computed = 0
    for r in range(dp):
        rows = lengths[r * per_rank : (r + 1) * per_rank]
        for i in range(0, len(rows), mbs):
            chunk = rows[i : i + mbs]
            computed += max(chunk) * len(chunk)
    return 1 - sum(lengths) / computed


def packed_waste(data, dp: int, capacity: int) -> float:
    """Padding fraction of the packed plan: computed tokens are the packed ones (lengths rounded by the plan)."""
    shards, _ = data.shard_by_batch_size(dp, sequence_packing_args={"max_tokens_per_microbatch": capacity})
    computed = sum(n for shard in shards for step in shard.micro_batch_lengths for n in step)
    return 1 - int(data["input_lengths"].sum()) / computed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="dtensor")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--capacity", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from rlcore.algorithms.sft.loss import NLLLoss
    from rlcore.config import load_config_dict
    from rlcore.distributed import RayVirtualCluster
    from rlcore.policy import Policy
    from rlcore.testing.models import build_tiny_tokenizer, tiny_model_path

    model = tiny_model_path(
        hidden_size=256,
        num_layers=4,
        num_heads=8,
        num_kv_heads=4,
        head_dim=32,
        intermediate_size=688,
        max_position_embeddings=1024,
    )
    lengths = long_tail_lengths(args.samples, args.max_len, seed=0)
    data = make_data(lengths, vocab=259, seed=0)
    tokenizer = build_tiny_tokenizer()
    base = {
        "backend": args.backend,
        "model_name": model,
        "train_global_batch_size": args.samples,
        "train_micro_batch_size": args.micro_batch,
        "max_total_sequence_length": args.max_len,
        "optimizer": {"name": "SGD", "kwargs": {"lr": 1e-4}},
    }
    packed_cfg = {
        **base,
        "sequence_packing": {"enabled": True, "train_mb_tokens": args.capacity, "logprob_mb_tokens": args.capacity},
    }
    cluster = RayVirtualCluster([2], max_colocated_worker_groups=2)  # both policies on the same two bundles
    policies = {
        "padded": Policy(cluster, load_config_dict({"policy": base}).policy, tokenizer, name_prefix="padded"),
        "packed": Policy(cluster, load_config_dict({"policy": packed_cfg}).policy, tokenizer, name_prefix="packed"),
    }
    times: dict[str, list[float]] = {"padded": [], "packed": []}
    try:
        losses = {name: float(p.train(data, NLLLoss())["loss"][0]) for name, p in policies.items()}  # warm-up
        for _ in range(args.repeats):
            for name, policy in policies.items():
                start = time.perf_counter()
                policy.train(data, NLLLoss())
                times[name].append(time.perf_counter() - start)
    finally:
        for p in policies.values():
            p.shutdown()
        cluster.shutdown()
    useful = sum(lengths)
    padded_s, packed_s = statistics.median(times["padded"]), statistics.median(times["packed"])
    result = {
        "padded_tok_s": round(useful / padded_s, 1),
        "packed_tok_s": round(useful / packed_s, 1),
        "speedup": round(padded_s / packed_s, 3),
        "padded_waste": round(padded_waste(lengths, 2, args.micro_batch), 4),
        "packed_waste": round(packed_waste(data, 2, args.capacity), 4),
    }
    print(f"warm-up loss  padded {losses['padded']:.6f}  packed {losses['packed']:.6f} (same data, same weights)")
    print(f"{'':8}{'step s (median)':>16}{'tokens/s':>12}{'waste':>8}")
    print(f"{'padded':8}{padded_s:>16.3f}{result['padded_tok_s']:>12.1f}{result['padded_waste']:>8.3f}")
    print(f"{'packed':8}{packed_s:>16.3f}{result['packed_tok_s']:>12.1f}{result['packed_waste']:>8.3f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
