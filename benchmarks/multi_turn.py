"""Generation throughput of a multi-turn rollout vs a single-turn one of the same total generated tokens.

One vLLM engine, one model (``small``: a ~24M-parameter Llama built from a
config, float32), ``--prompts`` random prompts of 16-48 tokens. Both sides go
through :func:`rlcore.run.rollouts.run_rollout`, the code a GRPO step runs:

- **1 turn**: ``max_new_tokens = turns x --tokens-per-turn``;
- **N turns**: ``max_new_tokens = --tokens-per-turn`` per turn; between turns an
  environment that never ends the episode answers with a ``--obs-tokens``-token
  observation, so each later turn re-sends (prefills) the whole sequence so far.

The random model rarely samples EOS (1 of ~260 tokens), so both sides generate
nearly the same number of tokens (each side's mean is printed); tokens/s is
generated tokens over the wall time of the rollout as the driver sees it
(generation, the environment step and the turn bookkeeping; the table splits
it into the engine calls and everything else). One engine
serves both sides; only ``max_new_tokens`` changes between them. After a warm-up
each, the sides alternate ``--repeats`` times; medians are reported.

    python benchmarks/multi_turn.py [--prompts 32] [--turns 3] [--tokens-per-turn 32] [--obs-tokens 8] [--repeats 5]

The last line printed is JSON: ``{"single_turn_tok_s": ..., "multi_turn_tok_s": ..., "ratio": ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from types import SimpleNamespace

from interleave import interleaved

MODEL = dict(
    arch="llama",
    hidden_size=512,
    num_layers=8,
    num_heads=8,
    num_kv_heads=4,
    head_dim=64,
    intermediate_size=1408,
    max_position_embeddings=512,
)
MAX_LEN = 512


class ChattyEnvironment:
    """Reward 0, never done, a fixed observation (the multi-turn side's environment)."""

    def __init__(self, observation: str) -> None:
        self.observation = observation

    def step(self, logs, metadata):
        from rlcore.interfaces.environment import EnvironmentReturn

        n = len(logs)
        return EnvironmentReturn(
            [{"role": "environment", "content": self.observation}] * n, list(metadata), [0.0] * n, [False] * n
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--tokens-per-turn", type=int, default=32)
    parser.add_argument("--obs-tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)

    import transformers

    from rl_vllm.generation import VllmGeneration
    from rlcore.config import load_config_dict
    from rlcore.datasets import Sample
    from rlcore.distributed import RayVirtualCluster, shutdown_ray
    from rlcore.run.rollouts import run_rollout
    from rlcore.run.step import Timer
    from rlcore.testing.models import build_tiny_tokenizer, make_batch, tiny_model_path

    transformers.utils.logging.disable_progress_bar()
    model_dir = tiny_model_path(**MODEL)
    tokenizer = build_tiny_tokenizer()
    raw = make_batch(tokenizer, args.prompts, 16, 48, seed=0)
    texts = [
        tokenizer.decode(row[:n].tolist(), skip_special_tokens=True)
        for row, n in zip(raw["input_ids"], raw["input_lengths"].tolist())
    ]
    samples = [Sample(i, [{"role": "user", "content": t}], {}) for i, t in enumerate(texts)]
    observation = "o" * args.obs_tokens  # one byte = one token for the tiny tokenizer
    total = args.turns * args.tokens_per_turn

    def engine_cfg(new_tokens: int):
        return load_config_dict(
            {
                "policy": {
                    "model_name": model_dir,
                    "precision": "float32",
                    "train_global_batch_size": 1,
                    "max_total_sequence_length": MAX_LEN,
                    "generation": {
                        "backend": "vllm",
                        "max_new_tokens": new_tokens,
                        "temperature": 1.0,
                        "pad_token_id": tokenizer.pad_token_id,
                        "vllm_cfg": {"kv_cache_space_gb": 0.25, "max_model_len": MAX_LEN},
                    },
                }
            }
        ).policy

    def run_cfg(turns: int):
        return SimpleNamespace(
            grpo=SimpleNamespace(max_rollout_turns=turns),
            policy=SimpleNamespace(
                max_total_sequence_length=MAX_LEN, tokenizer=SimpleNamespace(chat_template_kwargs={})
            ),
        )

    print(
        f"model small ({MODEL['hidden_size']}x{MODEL['num_layers']}, float32); {args.prompts} prompts of 16-48 "
        f"tokens; 1 turn x {total} tokens vs {args.turns} turns x {args.tokens_per_turn} tokens with a "
        f"{args.obs_tokens}-token observation between turns; one vLLM engine; {args.repeats} repeats after a "
        f"warm-up; load average {os.getloadavg()[0]:.1f}",
        file=sys.stderr,
    )
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    cluster = RayVirtualCluster([1], max_colocated_worker_groups=1, name="bench-multi-turn")
    engine = None
    try:
        engine = VllmGeneration(cluster, engine_cfg(total).generation, name_prefix="bench-multi-turn")
        sides = {"single": (1, total), "multi": (args.turns, args.tokens_per_turn)}

        def rate(side: str) -> tuple[float, float, float, float]:
            """Tokens/s, tokens per sample, seconds in the engine, seconds elsewhere."""
            turns, new_tokens = sides[side]
            engine.cfg = engine.cfg.model_copy(update={"max_new_tokens": new_tokens})  # read at every request
            timer = Timer()
            t0 = time.perf_counter()
            rollout = run_rollout(
                run_cfg(turns),
                lambda b: engine.generate(b, greedy=False),
                ChattyEnvironment(observation),
                tokenizer,
                samples,
                1,
                timer,
            )
            seconds = time.perf_counter() - t0
            generated = float(rollout.data["generation_lengths"].sum())
            in_engine = timer.seconds["time/generation_s"]
            return generated / seconds, generated / len(samples), in_engine, seconds - in_engine

        runs = interleaved(sides, rate, args.repeats)
    finally:
        if engine is not None:
            engine.shutdown()
        cluster.shutdown()
        shutdown_ray()

    rates, lengths, engine_s, other_s = ({side: [run[k] for run in r] for side, r in runs.items()} for k in range(4))
    med = {side: statistics.median(r) for side, r in rates.items()}
    print(
        f"{'rollout':<10}{'median tok/s':>14}{'min':>10}{'max':>10}{'tokens/sample':>15}{'engine s':>10}{'other s':>9}"
    )
    for side in rates:
        print(
            f"{side:<10}{med[side]:>14.1f}{min(rates[side]):>10.1f}{max(rates[side]):>10.1f}"
            f"{statistics.mean(lengths[side]):>15.1f}{statistics.median(engine_s[side]):>10.2f}"
            f"{statistics.median(other_s[side]):>9.3f}"
        )
    ratio = med["multi"] / med["single"]
    print(f"{args.turns}-turn / 1-turn tokens/s: {ratio:.2f}x")
    print(
        json.dumps(
            {
                "single_turn_tok_s": round(med["single"], 1),
                "multi_turn_tok_s": round(med["multi"], 1),
                "ratio": round(ratio, 3),
                "load": round(os.getloadavg()[0], 1),
            }
        )
    )


if __name__ == "__main__":
    main()
