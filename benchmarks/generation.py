"""Generation throughput: the ``vllm`` backend vs ``fsdp1``'s Hugging Face ``generate``.

The same model (a Llama built from a config: ``small``, ~24M parameters, by
default, or ``tiny-llama``, the ~0.5M-parameter model of
``examples/grpo_tiny.yaml``; float32) and the same prompts (``--prompts``
random prompts of 16-48 tokens), sampled at temperature 1 for up to
``--new-tokens`` tokens, through each backend's rlcore facade:

- **vllm**: ``VllmGeneration.generate`` (``--ranks`` engines, data parallel);
- **fsdp1**: ``Policy.generate`` of an ``fsdp1`` policy (``--ranks`` ranks,
  each running HF ``generate`` on the gathered parameters).

Both live in one Ray cluster (the engine and the training rank of a bundle
share it, ``max_colocated_worker_groups=2``), one torch thread per process.
After a warm-up call each, the two are called alternately ``--repeats``
times (so load from other processes hits both alike). Tokens/s counts
generated tokens (``generation_lengths``, so a row that stops at EOS counts
what it produced) over the wall time of the facade call, as the driver sees
it; the median over repeats is reported.

    python benchmarks/generation.py [--model small|tiny-llama] [--prompts 32] [--new-tokens 64] [--ranks 1]
        [--repeats 5]
        [--compile]

``--compile`` runs the engines with ``vllm_cfg.enforce_eager: false`` (vLLM
compiles the model; on CPU about 20-30 s more engine start-up, not timed).

The last line printed is JSON: ``{"vllm_tok_s": ..., "fsdp1_tok_s": ..., "speedup": ...}`` (goal >= 3x).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from interleave import interleaved

MODELS = {
    # ~24M parameters: tiny-llama-shaped, big enough that the model's own work is not negligible.
    "small": dict(
        arch="llama",
        hidden_size=512,
        num_layers=8,
        num_heads=8,
        num_kv_heads=4,
        head_dim=64,
        intermediate_size=1408,
        max_position_embeddings=512,
    ),
    # examples/grpo_tiny.yaml's model (~0.5M parameters): per-token overheads dominate.
    "tiny-llama": "tiny-llama",
}
MAX_LEN = 256


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="small")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--ranks", type=int, default=1, help="vLLM engines = fsdp1 ranks")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--compile", action="store_true", help="vllm_cfg.enforce_eager=false (compiled engine)")
    args = parser.parse_args(argv)

    import transformers

    from rl_vllm.generation import VllmGeneration
    from rlcore.config import load_config_dict
    from rlcore.data import BatchedDataDict
    from rlcore.distributed import RayVirtualCluster, shutdown_ray
    from rlcore.models import BUILTIN_MODELS
    from rlcore.policy import Policy
    from rlcore.testing.models import build_tiny_tokenizer, make_batch, tiny_model_path

    transformers.utils.logging.disable_progress_bar()
    spec = MODELS[args.model]
    spec = BUILTIN_MODELS[spec] if isinstance(spec, str) else spec
    model_dir = tiny_model_path(**spec)
    tokenizer = build_tiny_tokenizer()
    raw = make_batch(tokenizer, args.prompts, 16, 48, seed=0)
    prompts = BatchedDataDict(input_ids=raw["input_ids"], input_lengths=raw["input_lengths"])
    generation = {
        "max_new_tokens": args.new_tokens,
        "temperature": 1.0,
        "top_p": 1.0,
        "pad_token_id": tokenizer.pad_token_id,
    }
    policy_cfg = {
        "model_name": model_dir,
        "precision": "float32",
        "train_global_batch_size": args.ranks,
        "max_total_sequence_length": MAX_LEN,
    }
    fsdp1_cfg = load_config_dict(
        {
            "cluster": {"workers_per_node": args.ranks},
            "policy": {**policy_cfg, "backend": "fsdp1", "generation": {**generation, "backend": "fsdp1"}},
        }
    ).policy
    vllm_cfg = load_config_dict(
        {
            "cluster": {"workers_per_node": args.ranks},
            "policy": {
                **policy_cfg,
                "generation": {
                    **generation,
                    "backend": "vllm",
                    "vllm_cfg": {
                        "kv_cache_space_gb": 0.25,
                        "max_model_len": MAX_LEN,
                        "enforce_eager": not args.compile,
                    },
                },
            },
        }
    ).policy
    params = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_pretrained(model_dir).parameters())
    print(
        f"model {args.model!r}: {spec}, {params / 1e6:.1f}M params float32; {args.prompts} prompts of 16-48 tokens x "
        f"{args.new_tokens} new tokens, temperature 1; {args.ranks} engine(s) / rank(s), vLLM "
        f"{'compiled' if args.compile else 'eager'}; {args.repeats} repeats "
        f"after 1 warm-up; load average {os.getloadavg()[0]:.1f}",
        file=sys.stderr,
    )

    cluster = RayVirtualCluster([args.ranks], max_colocated_worker_groups=2, name="bench-generation")
    policy = engines = None
    try:
        policy = Policy(cluster, fsdp1_cfg, tokenizer, init_optimizer=False, init_reference_model=False)
        engines = VllmGeneration(cluster, vllm_cfg.generation, name_prefix="bench-vllm")
        sides = {"vllm": engines, "fsdp1": policy}

        def tok_s(side: str) -> tuple[float, float]:
            t0 = time.perf_counter()
            out = sides[side].generate(prompts, greedy=False)
            seconds = time.perf_counter() - t0
            return float(out["generation_lengths"].sum()) / seconds, float(out["generation_lengths"].float().mean())

        runs = interleaved(sides, tok_s, args.repeats)
    finally:
        for owner in (engines, policy):
            if owner is not None:
                owner.shutdown()
        cluster.shutdown()
        shutdown_ray()

    rates = {side: [rate for rate, _ in r] for side, r in runs.items()}
    lengths = {side: [length for _, length in r] for side, r in runs.items()}
    med = {side: statistics.median(r) for side, r in rates.items()}
    print(f"{'backend':<10}{'median tok/s':>14}{'min':>10}{'max':>10}{'mean new tokens':>17}")
    for side in rates:
        print(
            f"{side:<10}{med[side]:>14.1f}{min(rates[side]):>10.1f}{max(rates[side]):>10.1f}"
            f"{statistics.mean(lengths[side]):>17.1f}"
        )
    speedup = med["vllm"] / med["fsdp1"]
    print(f"vllm / fsdp1: {speedup:.2f}x (goal >= 3)")
    print(
        json.dumps(
            {"vllm_tok_s": round(med["vllm"], 1), "fsdp1_tok_s": round(med["fsdp1"], 1), "speedup": round(speedup, 2)}
        )
    )


if __name__ == "__main__":
    main()
