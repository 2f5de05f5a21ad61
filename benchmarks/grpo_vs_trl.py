"""GRPO step time: rlcore's loop (``rlcore run``) vs TRL's ``GRPOTrainer``, side by side.

The same model (a Llama built from a config), the same prompts (the toy
"write digits" task: ``digit_prompts(step, n)``, rewarded by
``digit_reward``), group size, generation length (sampling at temperature 1,
stop at EOS), learning rate (constant, AdamW without weight decay), gradient
clipping (1.0), loss (clipped policy gradient, eps 0.2, no KL), group
mean/std advantages, one optimizer step per GRPO step and the same number of
steps through:

- **rlcore**: ``rlcore.run.train.train(cfg)``: ``dtensor`` training on
  ``--ranks`` ranks (one torch thread each) with ``vllm`` generation
  colocated (one engine, one thread, per rank's bundle), refit through shared
  memory every step. Step time is the loop's own ``time/step_s`` (refit +
  generation + logprobs + train).
- **TRL**: ``GRPOTrainer`` in this process (HF ``generate``, ``use_cpu=True``,
  ``--ranks`` torch threads), micro-batches of the same total size as
  rlcore's (``ranks x micro_batch``), gradient accumulation up to the whole
  group batch. Step time is the wall time of one optimizer step (callback
  ``on_step_begin`` .. ``on_step_end``, generation included).

Both sides get the same number of threads. The default is one: on this
shared 2-core box a 2-thread torch process is badly hurt by other load
(OpenMP threads waiting on each other; TRL's tiny-case step went from 0.3 s
to 5 s), which would measure the box rather than the frameworks.

The first step of each is a warm-up and is not counted; the median of the
rest is reported. The two runs are sequential (rlcore first), so load from
other processes is not shared equally: rerun to see the spread.

Cases (``--case``):

- ``shaped`` (default): a workload shaped like real RL, where generation
  dominates: a ~50M-parameter Llama, 16 prompts x 8 generations, 128 new tokens;
- ``varlen``: the shaped model and batch, 256 new tokens at most, but the
  model ends completions at EOS after a long-tailed number of tokens (mean
  ~40; :func:`with_stop_habit`), as the answers of every real RL task do.
  Generation and training then see ragged batches: what rlcore's engine
  (continuous batching) and training (packing, micro-batches cut to their
  own longest row) are built for, and what padded HF ``generate`` and
  TRL's padded training batches pay for;
- ``tiny``: ``examples/grpo_tiny.yaml``'s tiny-llama (~0.5M parameters), 8
  prompts x 4 generations, 16 new tokens, where TRL's in-process loop pays no
  dispatch cost: the other side of the crossover.

Needs ``trl`` (``pip install trl==1.16.0``; not a dependency of rlcore).

    python benchmarks/grpo_vs_trl.py [--case shaped|varlen|tiny] [--ranks 1] [--steps N] [--prompts P]
        [--generations G] [--new-tokens T] [--packing auto|on|off]

The last line printed is JSON: ``{"rlcore_step_s", "trl_step_s", "speedup",
"model_params", "new_tokens", "case", "packing", "rlcore_mean_len", "trl_mean_len",
"rlcore_reward", "trl_reward"}`` (speedup = trl / rlcore, goal >= 2x for ``varlen``,
>= 1.3x for ``shaped``; rewards are [first step, last step]).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CASES: dict[str, dict[str, Any]] = {
    "shaped": dict(
        model=dict(
            arch="llama",
            hidden_size=768,
            num_layers=8,
            num_heads=12,
            num_kv_heads=4,
            head_dim=64,
            intermediate_size=2048,
            max_position_embeddings=512,
        ),
        # The KV cache holds the whole rollout at once (128 sequences x 2 blocks of 128 tokens on CPU, 16 KB a
        # token): HF generate holds every row too. At 0.25 GB half the rollout waited for the other half.
        prompts=16,
        generations=8,
        new_tokens=128,
        lr=1e-5,
        micro_batch=16,
        steps=3,
        max_len=256,
        kv_cache_gb=0.5,
    ),
    # The shaped model and batch, but completions end at EOS after a long-tailed number of tokens (see
    # with_stop_habit): mean ~40, a few run to the 256-token cap, as the answers of a real task do.
    "varlen": dict(
        model=dict(
            arch="llama",
            hidden_size=768,
            num_layers=8,
            num_heads=12,
            num_kv_heads=4,
            head_dim=64,
            intermediate_size=2048,
            max_position_embeddings=512,
        ),
        prompts=16,
        generations=8,
        new_tokens=256,
        mean_length=40,
        lr=1e-5,
        micro_batch=16,
        steps=3,
        max_len=384,
        kv_cache_gb=0.5,
    ),
    "tiny": dict(
        model="tiny-llama",
        prompts=8,
        generations=4,
        new_tokens=16,
        lr=3e-3,
        micro_batch=8,
        steps=8,
        max_len=64,
        kv_cache_gb=0.0625,
    ),
}


def median_after_warmup(values: list[float]) -> float:
    return statistics.median(values[1:] if len(values) > 1 else values)


# --------------------------------------------------------------------------- the varlen model


# The constant embedding coordinate that carries the stop habit. It must dwarf what the layers add to that
# coordinate: at 3, one AdamW step at lr 1e-5 took p(EOS) from 1/40 to 1/210 (every completion then runs to
# the cap); at 30 it stays at 1/40 for several steps, and the other logits are as random as before.
STOP_FEATURE = 30.0


def with_stop_habit(model_dir: str, mean_length: float, dest: str, banned: tuple[int, ...] = ()) -> str:
    """A copy of ``model_dir`` that ends a completion at EOS with probability ~1/``mean_length`` per token.

    A random model almost never samples EOS, so every completion runs to the cap. Here one embedding
    coordinate is set to a constant for every token: after the final norm that coordinate is nearly
    constant (other coordinates, and so the other logits, barely change), and the EOS row of the LM
    head reads only it, with a scale found by bisection on random contexts. Lengths are then about
    geometric: a long tail up to ``max_new_tokens``, the same model on both sides. The ``banned`` tokens'
    rows read the same coordinate with a large negative scale: never sampled (a VLM's image placeholders,
    which rlcore cuts a completion before and TRL suppresses, would make the two sides' lengths differ).
    Works for causal LMs and image-text models (their language model's hidden states); the directory's other
    files (an image processor's) are copied along.
    """
    import torch
    from transformers import AutoConfig, AutoTokenizer

    from rlcore.training.vision import model_class

    model = model_class(AutoConfig.from_pretrained(model_dir)).from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    eos, vocab = tokenizer.eos_token_id, model.get_output_embeddings().weight.shape[0]
    head = model.get_output_embeddings().weight
    decoder = getattr(model.model, "language_model", model.model)
    contexts = torch.randint(0, vocab, (8, 128), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.get_input_embeddings().weight[:, 0] = STOP_FEATURE
        hidden = decoder(contexts).last_hidden_state
        head[eos] = 0.0
        low, high = 0.0, 50.0
        for _ in range(40):
            head[eos, 0] = (low + high) / 2
            p_eos = torch.softmax(model.get_output_embeddings()(hidden), dim=-1)[..., eos].mean()
            low, high = (head[eos, 0].item(), high) if p_eos < 1 / mean_length else (low, head[eos, 0].item())
        for token in banned:
            head[token] = 0.0
            head[token, 0] = -50.0
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    for path in Path(model_dir).iterdir():
        if path.is_file() and not (Path(dest) / path.name).exists():
            shutil.copy(path, dest)
    return dest


# --------------------------------------------------------------------------- rlcore


def run_rlcore(
    model_dir: str, c: dict[str, Any], out_dir: str, ranks: int, packing: bool | None = None
) -> list[dict[str, Any]]:
    """``rlcore run`` with this workload; returns its per-step metrics rows. ``packing``: the
    ``policy.sequence_packing.enabled`` to use (None: rlcore's default)."""
    from rlcore.config import load_config_dict
    from rlcore.run.metrics import read_metrics
    from rlcore.run.train import train

    cfg = load_config_dict(
        {
            "cluster": {"workers_per_node": ranks},
            "policy": {
                "backend": "dtensor",
                "model_name": model_dir,
                "precision": "float32",
                "train_global_batch_size": c["prompts"] * c["generations"],  # one optimizer step per GRPO step
                "train_micro_batch_size": c["micro_batch"],
                "logprob_batch_size": c["micro_batch"],
                "max_total_sequence_length": c["max_len"],
                "learning_rate": c["lr"],
                "max_grad_norm": 1.0,
                "optimizer": {"name": "torch.optim.AdamW", "kwargs": {"lr": c["lr"], "weight_decay": 0.0}},
                "sequence_packing": {"enabled": packing},
                "generation": {
                    "backend": "vllm",
                    "max_new_tokens": c["new_tokens"],
                    "temperature": 1.0,
                    "top_p": 1.0,
                    "colocated": True,
                    "vllm_cfg": {"kv_cache_space_gb": c["kv_cache_gb"], "max_model_len": c["max_len"]},
                },
            },
            "grpo": {
                "num_prompts_per_step": c["prompts"],
                "num_generations_per_prompt": c["generations"],
                "max_num_steps": c["steps"],
                "advantage_estimator": "mean_std",
                "seed": 0,
            },
            "loss": {"reference_policy_kl_penalty": 0.0, "ratio_clip_min": 0.2, "ratio_clip_max": 0.2},
            "logger": {"output_dir": out_dir, "tensorboard": False, "progress_bar": False},
            "checkpointing": {"enabled": False},
        }
    )
    summary = train(cfg)
    return read_metrics(summary["metrics"])


# --------------------------------------------------------------------------- TRL


def run_trl(
    model_dir: str, c: dict[str, Any], out_dir: str, ranks: int
) -> tuple[list[float], list[float], list[dict[str, Any]]]:
    """TRL's GRPOTrainer on the same workload; returns step seconds, generate seconds per step, and its logs."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlcore.run.tasks.toy import digit_prompts, digit_reward

    torch.set_num_threads(ranks)
    group_batch = c["prompts"] * c["generations"]
    micro = ranks * c["micro_batch"]  # what rlcore's ranks process per micro-step together
    prompts = [p for step in range(c["steps"]) for p in digit_prompts(step, c["prompts"], seed=0)]

    def reward(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
        return digit_reward(prompts, completions)

    args = GRPOConfig(
        output_dir=out_dir,
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=group_batch // micro,
        num_generations=c["generations"],
        max_completion_length=c["new_tokens"],
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        learning_rate=c["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=0.0,
        epsilon=0.2,
        num_iterations=1,
        scale_rewards="group",
        max_steps=c["steps"],
        shuffle_dataset=False,
        seed=0,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    generate_s: list[float] = []
    plain_generate = model.generate

    def timed_generate(*a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return plain_generate(*a, **kw)
        finally:
            generate_s.append(time.perf_counter() - t0)

    model.generate = timed_generate  # TRL calls the (unwrapped) model's generate

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.steps: list[float] = []
            self.generate: list[float] = []
            self.logs: list[dict[str, Any]] = []

        def on_step_begin(self, *a: Any, **kw: Any) -> None:
            self._t0, self._g0 = time.perf_counter(), len(generate_s)

        def on_step_end(self, *a: Any, **kw: Any) -> None:
            self.steps.append(time.perf_counter() - self._t0)
            self.generate.append(sum(generate_s[self._g0 :]))

        def on_log(self, *a: Any, logs: dict[str, Any] | None = None, **kw: Any) -> None:
            self.logs.append(dict(logs or {}))

    timer = StepTimer()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        callbacks=[timer],
    )
    trainer.remove_callback(PrinterCallback)  # its per-step dicts would bury the table
    trainer.train()
    return timer.steps, timer.generate, [log for log in timer.logs if "reward" in log]


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", choices=sorted(CASES), default="shaped")
    parser.add_argument("--steps", type=int, help="GRPO steps of each run (the first is a warm-up)")
    parser.add_argument("--prompts", type=int)
    parser.add_argument("--generations", type=int)
    parser.add_argument("--new-tokens", type=int)
    parser.add_argument("--ranks", type=int, default=1, help="rlcore ranks (one thread each) = TRL torch threads")
    parser.add_argument(
        "--packing",
        choices=("auto", "on", "off"),
        default="auto",
        help="rlcore's policy.sequence_packing.enabled (auto: its default)",
    )
    args = parser.parse_args(argv)

    import transformers

    from rlcore.models import BUILTIN_MODELS
    from rlcore.testing.models import tiny_model_path

    c = dict(CASES[args.case])
    for key in ("steps", "prompts", "generations", "new_tokens"):
        if getattr(args, key) is not None:
            c[key] = getattr(args, key)
    spec = BUILTIN_MODELS[c["model"]] if isinstance(c["model"], str) else c["model"]
    transformers.utils.logging.disable_progress_bar()
    model_dir = tiny_model_path(**spec)
    params = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_pretrained(model_dir).parameters())
    print(
        f"case {args.case!r}: llama {spec}, {params / 1e6:.1f}M params float32; {c['prompts']} prompts x "
        f"{c['generations']} generations x {c['new_tokens']} new tokens, lr {c['lr']}, {c['steps']} steps "
        f"(first = warm-up), {args.ranks} rank(s)/thread(s) each; load average {os.getloadavg()[0]:.1f}",
        file=sys.stderr,
    )

    work = tempfile.mkdtemp(prefix="grpo-vs-trl-")
    try:
        load = {"rlcore": os.getloadavg()[0]}
        if c.get("mean_length"):
            model_dir = with_stop_habit(model_dir, c["mean_length"], os.path.join(work, "model"))
        packing = {"auto": None, "on": True, "off": False}[args.packing]
        rows = run_rlcore(model_dir, c, os.path.join(work, "rlcore"), args.ranks, packing)
        load["trl"] = os.getloadavg()[0]
        trl_steps, trl_generate, trl_logs = run_trl(model_dir, c, os.path.join(work, "trl"), args.ranks)
        load["end"] = os.getloadavg()[0]
    finally:
        shutil.rmtree(work, ignore_errors=True)

    ours = median_after_warmup([r["time/step_s"] for r in rows])
    theirs = median_after_warmup(trl_steps)
    phases = {
        p: median_after_warmup([r.get(f"time/{p}_s", 0.0) for r in rows])
        for p in ("refit", "generation", "logprob", "train")
    }
    print(f"load average at start of rlcore {load['rlcore']:.1f}, of TRL {load['trl']:.1f}, at end {load['end']:.1f}")
    print(f"{'median s per step':<22}{'step':>8}{'generate':>10}{'rest':>8}{'mean len':>10}{'reward first/last':>20}")
    gen_len = [r["mean_generation_length"] for r in rows[1:]] or [rows[0]["mean_generation_length"]]
    print(
        f"{'rlcore (dtensor+vllm)':<22}{ours:>8.2f}{phases['generation']:>10.2f}{ours - phases['generation']:>8.2f}"
        f"{statistics.mean(gen_len):>10.1f}{rows[0]['reward_mean']:>10.3f}{rows[-1]['reward_mean']:>10.3f}"
    )
    trl_gen = median_after_warmup(trl_generate)
    trl_len = [log.get("completions/mean_length", float("nan")) for log in trl_logs[1:]] or [float("nan")]
    trl_reward = [log["reward"] for log in trl_logs] or [float("nan")]
    print(
        f"{'TRL GRPOTrainer':<22}{theirs:>8.2f}{trl_gen:>10.2f}{theirs - trl_gen:>8.2f}"
        f"{statistics.mean(trl_len):>10.1f}{trl_reward[0]:>10.3f}{trl_reward[-1]:>10.3f}"
    )
    print("rlcore phases (median s): " + ", ".join(f"{p} {v:.2f}" for p, v in phases.items()))
    print(
        f"per-step seconds: rlcore {[round(r['time/step_s'], 2) for r in rows]}, TRL {[round(s, 2) for s in trl_steps]}"
    )
    speedup = theirs / ours
    goal = {"varlen": " (goal >= 2)", "shaped": " (goal >= 1.3)"}.get(args.case, "")
    print(f"TRL / rlcore step time: {speedup:.2f}x{goal}")
    print(
        json.dumps(
            {
                "rlcore_step_s": round(ours, 3),
                "trl_step_s": round(theirs, 3),
                "speedup": round(speedup, 2),
                "model_params": params,
                "new_tokens": c["new_tokens"],
                "case": args.case,
                "packing": args.packing,
                "rlcore_mean_len": round(statistics.mean(gen_len), 1),
                "trl_mean_len": round(statistics.mean(trl_len), 1),
                "rlcore_reward": [round(rows[0]["reward_mean"], 3), round(rows[-1]["reward_mean"], 3)],
                "trl_reward": [round(trl_reward[0], 3), round(trl_reward[-1], 3)],
            }
        )
    )


if __name__ == "__main__":
    main()
