"""Asynchronous vs synchronous GRPO: the same run, generation on its own core, step time side by side.

Both runs are ``rlcore run`` on ``examples/grpo_async_tiny.yaml``'s layout: one
CPU worker trains (dtensor), a vLLM engine on the other generates. The only
difference is ``grpo.async_grpo.enabled``: synchronous, the engine and the
trainer take turns (step = refit + generation + logprobs + train); async, the
engine generates the next rollout while the trainer trains (step ~ max of the
two + refit), on weights one step older (``max_trajectory_age_steps: 1``,
importance-weighted).

    python benchmarks/async_grpo.py                    # tiny-llama, 16 prompts x 4, 32 new tokens, 20 steps
    python benchmarks/async_grpo.py --model 10m --new-tokens 48 --steps 12   # training-bound: less to overlap

Step time is the loop's ``time/step_s`` (async: wall time from waiting for the
rollout to the next refit), median over the steps after ``--warmup``. The
last line printed is JSON: ``async_vs_sync`` (median async step / median
sync step; goal <= 0.65), both medians, the phase medians, and each run's
first and last mean reward.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from scaling import SIZES, model_dir_for  # noqa: E402  (the sibling benchmark's helpers)

EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "grpo_async_tiny.yaml")
PHASES = (
    "time/generation_s",
    "time/train_s",
    "time/refit_s",
    "time/logprob_s",
    "time/generation_wait_s",
    "time/generation_idle_s",
)


def run(model_dir: str, args: argparse.Namespace, asynchronous: bool, out_dir: str) -> list[dict[str, Any]]:
    """One ``rlcore run``; its per-step metrics rows."""
    from rlcore.config import load_config
    from rlcore.run.metrics import read_metrics
    from rlcore.run.train import train

    cfg = load_config(
        EXAMPLE,
        [
            f"policy.model_name={model_dir}",
            f"grpo.max_num_steps={args.steps}",
            f"grpo.num_prompts_per_step={args.prompts}",
            f"grpo.num_generations_per_prompt={args.generations}",
            f"policy.train_global_batch_size={args.prompts * args.generations}",
            f"policy.generation.max_new_tokens={args.new_tokens}",
            f"policy.max_total_sequence_length={args.new_tokens + 32}",
            f"grpo.async_grpo.enabled={str(asynchronous).lower()}",
            f"logger.output_dir={out_dir}",
            "logger.progress_bar=false",
            "logger.tensorboard=false",
            "checkpointing.enabled=false",
        ],
    )
    return read_metrics(train(cfg)["metrics"])


def median(rows: list[dict[str, Any]], key: str, warmup: int) -> float:
    values = [r[key] for r in rows[warmup:] if key in r]
    return statistics.median(values) if values else float("nan")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-llama", help=f"a built-in model name, or one of {sorted(SIZES)}")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the medians")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args(argv)

    from rlcore.models import resolve_model

    model_dir = model_dir_for(args.model)[0] if args.model in SIZES else resolve_model(args.model)
    load = os.getloadavg()[0]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode, asynchronous in (("sync", False), ("async", True)):
            rows = run(model_dir, args, asynchronous, os.path.join(tmp, mode))
            results[mode] = {
                "step_s": median(rows, "time/step_s", args.warmup),
                **{key.removeprefix("time/"): median(rows, key, args.warmup) for key in PHASES},
                "first_reward": rows[0]["reward_mean"],
                "last_reward": rows[-1]["reward_mean"],
                "max_age": max(r.get("async/age_max", 0.0) for r in rows),
            }
    sync, asyn = results["sync"], results["async"]
    print(
        f"model {args.model}, {args.prompts}x{args.generations} rollouts of {args.new_tokens} new tokens, "
        f"{args.steps} steps (medians after {args.warmup}), load {load:.1f}"
    )
    print(f"{'':6}{'step s':>8}{'gen s':>8}{'train s':>9}{'refit s':>9}{'wait s':>8}{'idle s':>8}{'reward':>14}")
    for mode, r in results.items():
        print(
            f"{mode:6}{r['step_s']:>8.2f}{r['generation_s']:>8.2f}{r['train_s']:>9.2f}{r['refit_s']:>9.2f}"
            f"{r['generation_wait_s']:>8.2f}{r['generation_idle_s']:>8.2f}"
            f"{r['first_reward']:>7.2f}->{r['last_reward']:.2f}"
        )
    print(
        json.dumps(
            {
                "async_vs_sync": asyn["step_s"] / sync["step_s"],
                "sync_step_s": sync["step_s"],
                "async_step_s": asyn["step_s"],
                "model": args.model,
                "load": load,
                "modes": results,
            }
        )
    )


if __name__ == "__main__":
    main()
