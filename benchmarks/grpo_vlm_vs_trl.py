"""VLM GRPO step time: rlcore's loop (``rlcore run``) vs TRL's ``GRPOTrainer``, side by side (issue 57).

``grpo_vs_trl.py``'s design on a vision-language model: the built-in tiny Qwen2.5-VL
(``rlcore.models.resolve_model("tiny-qwen2.5-vl")``: a 2-block vision tower on a 2-layer decoder, random
weights), the same pictures and questions (``rlcore.environments.vlm_tasks.count_squares(step, n, seed=0)``,
``examples/grpo_vlm_tiny.yaml``'s task), the same reward (``count_reward``: format 0.2 + count 0.8, summed),
group size, generation length (sampling at temperature 1, stop at EOS), learning rate (constant, AdamW
without weight decay), gradient clipping (1.0), loss (clipped policy gradient, eps 0.2, no KL), group
mean/std advantages, one optimizer step per GRPO step and the same number of steps through:

- **rlcore**: ``rlcore.run.train.train(cfg)`` as ``examples/grpo_vlm_tiny.yaml`` runs it: ``dtensor`` training
  (vision tower included) on ``--ranks`` ranks (one torch thread each) with ``vllm`` generation colocated,
  the images handed to the engine with the prompt (docs/vision.md). Step time is the loop's own
  ``time/step_s`` (refit + generation + logprobs + train).
- **TRL**: ``GRPOTrainer`` in this process with the same model loaded by ``AutoModelForImageTextToText``
  and its processor (``rlcore.models.load_vlm_processor``) as ``processing_class``, fed a dataset of
  conversational prompts (the question) and an ``image`` column (the same PIL pictures, in the same order):
  TRL puts the image part before the text, as ``count_squares`` does. HF ``generate``, ``use_cpu=True``,
  ``--ranks`` torch threads, micro-batches of ``ranks x micro_batch`` rows, gradient accumulation up to the
  whole group batch. Step time is the wall time of one optimizer step (``on_step_begin`` ..
  ``on_step_end``, generation included).

Measurement, threads and the helpers (``median_after_warmup``) are ``grpo_vs_trl.py``'s: the first step of
each side is a warm-up and not counted, the median of the rest is reported, the two runs are sequential
(rlcore first), and the load average is quoted at the start of each and at the end.

Cases (``--case``):

- ``tiny`` (default): the example's shape: 8 prompts x 4 generations, 4 new tokens, 56 x 56 pictures
  (4 image tokens) of 1-3 squares;
- ``shaped``: the same model with a larger rollout: 16 prompts x 8 generations, 64 new tokens, 112 x 112
  pictures (16 image tokens) of 1-4 squares, where generation is a larger part of the step;
- ``varlen``: ``grpo_vs_trl.py``'s varlen case with pictures: its ~50M decoder under a small vision tower
  (random weights, built here), 16 prompts x 8 generations of at most 256 tokens that end at EOS after a
  long-tailed number of tokens (mean ~40: ``with_stop_habit``, which also keeps the model from sampling image
  placeholders, so both sides' completions run alike), 112 x 112 pictures; rlcore packs its micro-batches.

The random model samples EOS about once in 300 tokens, so most completions run to the cap. rlcore also cuts a
completion before an image or video placeholder it samples (``image_placeholder_cuts``), where TRL suppresses the
image token in ``generate``: rlcore's completions are about 15% shorter at 64 new tokens (a trained model samples
no placeholders). The vLLM engine gets ``max_num_batched_tokens`` of the whole rollout, so that no prompt is
prefilled in chunks: on vLLM's CPU platform a seeded request (rlcore seeds each one) crashes in a chunked prefill
("CPU Generator does not use offset").

Needs ``trl`` (``pip install trl==1.16.0``; not a dependency of rlcore).

    python benchmarks/grpo_vlm_vs_trl.py [--case tiny|shaped|varlen] [--ranks 1] [--steps N] [--prompts P]
        [--generations G] [--new-tokens T] [--image-size PX] [--json-out FILE]

The last line printed is JSON: ``{"rlcore_step_s", "trl_step_s", "speedup", "model_params", "case", ...,
"load"}`` (speedup = trl / rlcore; issue 57's goal is >= 2x; rewards are [first step, last step]).
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grpo_vs_trl import median_after_warmup, with_stop_habit  # noqa: E402  (the text benchmark's measurement)

MODEL = "tiny-qwen2.5-vl"
GENERATOR = "rlcore.environments.vlm_tasks:count_squares"
REWARD = "rlcore.environments.vlm_tasks:count_reward"

CASES: dict[str, dict[str, Any]] = {
    # examples/grpo_vlm_tiny.yaml's rollout (its steps cut to 8; grpo_vs_trl's tiny case takes 8).
    "tiny": dict(
        prompts=8,
        generations=4,
        new_tokens=4,
        image_size=56,
        max_count=3,
        lr=3e-3,
        micro_batch=8,
        steps=8,
        kv_cache_gb=0.0625,
    ),
    # A larger rollout on the same model: 128 completions of 64 tokens, 16 image tokens per prompt.
    "shaped": dict(
        prompts=16,
        generations=8,
        new_tokens=64,
        image_size=112,
        max_count=4,
        lr=3e-3,
        micro_batch=16,
        steps=4,
        kv_cache_gb=0.25,
    ),
    # grpo_vs_trl's varlen case with pictures: its ~50M decoder (here under a small vision tower), 16 prompts x 8
    # generations of at most 256 tokens that end at EOS after a long-tailed number of tokens (mean ~40,
    # with_stop_habit), 16 image tokens per prompt; rlcore packs its micro-batches (docs/vision.md).
    "varlen": dict(
        model=dict(
            hidden_size=768,
            num_layers=8,
            num_heads=12,
            num_kv_heads=4,
            intermediate_size=2048,
            mrope_section=(8, 12, 12),
            vision_hidden_size=128,
            vision_intermediate_size=256,
            max_position_embeddings=512,
        ),
        prompts=16,
        generations=8,
        new_tokens=256,
        mean_length=40,
        image_size=112,
        max_count=4,
        lr=1e-5,
        micro_batch=16,
        steps=3,
        # 128 sequences of up to 107 + 256 tokens: at 0.5 GB (256 blocks of 128 tokens) the engine warned that the
        # rollout would run in waves, and generation took 49 s against TRL's 79 s (1.70x the whole step).
        kv_cache_gb=1.0,
        packing=True,
    ),
}


#: The prompt's text tokens under the tiny model's chat template (BOS, headers, vision start/end, the question).
PROMPT_TEXT_TOKENS = 91


def max_len(c: dict[str, Any]) -> int:
    """``max_total_sequence_length`` (and the engine's ``max_model_len``): prompt (text + one token per 28 x 28
    pixels) and completion, rounded up to 64 (tiny: 128, shaped: 192, varlen: 384)."""
    need = PROMPT_TEXT_TOKENS + (c["image_size"] // 28) ** 2 + c["new_tokens"]
    return -(-need // 64) * 64


def task_rows(c: dict[str, Any], step: int) -> list[dict[str, Any]]:
    """The rows rlcore's generator source makes for ``step`` (``fn(step, n, seed=grpo.seed, **kwargs)``)."""
    from rlcore.environments.vlm_tasks import count_squares

    return count_squares(step, c["prompts"], seed=0, size=c["image_size"], max_count=c["max_count"])


def model_name(c: dict[str, Any]) -> str:
    if "model" not in c:
        return MODEL
    m = c["model"]
    return f"qwen2.5-vl {m['hidden_size']}x{m['num_layers']} (random, stop habit)"


def case_model(c: dict[str, Any], work: str) -> str:
    """The case's model directory: the built-in tiny VLM, or one built from ``c["model"]`` (random weights) and
    given grpo_vs_trl's stop habit, its image placeholders never sampled (see ``with_stop_habit``)."""
    from rlcore.models import build_tiny_vlm, resolve_model
    from rlcore.models.vlm import VISION_TOKENS

    if "model" not in c:
        return resolve_model(MODEL)
    from transformers import AutoTokenizer

    base = build_tiny_vlm(os.path.join(work, "base"), **c["model"])
    vocab = AutoTokenizer.from_pretrained(base).get_vocab()
    banned = tuple(vocab[token] for token in VISION_TOKENS)
    return with_stop_habit(base, c["mean_length"], os.path.join(work, "model"), banned=banned)


# --------------------------------------------------------------------------- rlcore


def run_rlcore(model_dir: str, c: dict[str, Any], out_dir: str, ranks: int) -> list[dict[str, Any]]:
    """``rlcore run`` with ``examples/grpo_vlm_tiny.yaml``'s layout and this workload; its per-step metrics rows."""
    from rlcore.config import load_config_dict
    from rlcore.run.metrics import read_metrics
    from rlcore.run.train import train

    cfg = load_config_dict(
        {
            "cluster": {"workers_per_node": ranks},
            "policy": {
                "backend": "dtensor",
                "model_name": model_dir,
                "tokenizer": {"chat_template": "default"},  # the model's own, as TRL's processor applies it
                "precision": "float32",
                "train_global_batch_size": c["prompts"] * c["generations"],  # one optimizer step per GRPO step
                "train_micro_batch_size": c["micro_batch"],
                "logprob_batch_size": c["micro_batch"],
                "max_total_sequence_length": c["max_len"],
                "learning_rate": c["lr"],
                "max_grad_norm": 1.0,
                "optimizer": {"name": "torch.optim.AdamW", "kwargs": {"lr": c["lr"], "weight_decay": 0.0}},
                "sequence_packing": {"enabled": c.get("packing", False)},
                "generation": {
                    "backend": "vllm",
                    "max_new_tokens": c["new_tokens"],
                    "temperature": 1.0,
                    "top_p": 1.0,
                    "colocated": True,
                    "vllm_cfg": {
                        "kv_cache_space_gb": c["kv_cache_gb"],
                        "max_model_len": c["max_len"],
                        # The whole rollout's prefill in one engine step: a prompt prefilled in chunks crashes a
                        # seeded request on vLLM's CPU platform ("CPU Generator does not use offset"; see README).
                        "engine_kwargs": {"max_num_batched_tokens": c["prompts"] * c["generations"] * c["max_len"]},
                    },
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
            "data": {
                "train": {
                    "generator": GENERATOR,
                    "generator_kwargs": {"size": c["image_size"], "max_count": c["max_count"]},
                }
            },
            "env": {"name": "python", "python_cfg": {"reward": REWARD}},
            "logger": {"output_dir": out_dir, "tensorboard": False, "progress_bar": False},
            "checkpointing": {"enabled": False},
        }
    )
    summary = train(cfg)
    return read_metrics(summary["metrics"])


# --------------------------------------------------------------------------- TRL


def trl_dataset(c: dict[str, Any]) -> Any:
    """Every step's rows in order, as TRL takes images: a conversational ``prompt`` (the question; TRL inserts
    the image part before it) and an ``image`` column; the count as ``answer``."""
    from datasets import Dataset

    prompts, images, answers = [], [], []
    for step in range(c["steps"]):
        for row in task_rows(c, step):
            (message,) = row["messages"]
            image_part, text_part = message["content"]
            assert image_part["type"] == "image" and text_part["type"] == "text"
            prompts.append([{"role": "user", "content": text_part["text"]}])
            images.append(image_part["image"])
            answers.append(row["output"])
    return Dataset.from_dict({"prompt": prompts, "image": images, "answer": answers})


def run_trl(
    model_dir: str, c: dict[str, Any], out_dir: str, ranks: int
) -> tuple[list[float], list[float], list[dict[str, Any]]]:
    """TRL's GRPOTrainer on the same workload; returns step seconds, generate seconds per step, and its logs."""
    import torch
    from transformers import AutoModelForImageTextToText, TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlcore.environments.vlm_tasks import count_reward
    from rlcore.models import load_vlm_processor

    torch.set_num_threads(ranks)
    group_batch = c["prompts"] * c["generations"]
    micro = ranks * c["micro_batch"]  # what rlcore's ranks process per micro-step together

    def reward(prompts: list[Any], completions: list[Any], answer: list[str], **_: Any) -> list[float]:
        texts = [x[-1]["content"] if isinstance(x, list) else x for x in completions]  # conversational: messages
        parts = count_reward(prompts, texts, [{"ground_truth": a} for a in answer])
        return [sum(values) for values in zip(*parts.values(), strict=True)]

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
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
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
        train_dataset=trl_dataset(c),
        processing_class=load_vlm_processor(model_dir),
        callbacks=[timer],
    )
    trainer.remove_callback(PrinterCallback)  # its per-step dicts would bury the table
    trainer.train()
    return timer.steps, timer.generate, [log for log in timer.logs if "reward" in log]


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", choices=sorted(CASES), default="tiny")
    parser.add_argument("--steps", type=int, help="GRPO steps of each run (the first is a warm-up)")
    parser.add_argument("--prompts", type=int)
    parser.add_argument("--generations", type=int)
    parser.add_argument("--new-tokens", type=int)
    parser.add_argument("--image-size", type=int, help="side of the square pictures in pixels (56: 4 image tokens)")
    parser.add_argument("--ranks", type=int, default=1, help="rlcore ranks (one thread each) = TRL torch threads")
    parser.add_argument("--json-out", help="also write the JSON line to this file")
    args = parser.parse_args(argv)

    import transformers

    c = dict(CASES[args.case])
    for key in ("steps", "prompts", "generations", "new_tokens", "image_size"):
        if getattr(args, key) is not None:
            c[key] = getattr(args, key)
    c["max_len"] = max_len(c)
    transformers.utils.logging.disable_progress_bar()
    work = tempfile.mkdtemp(prefix="grpo-vlm-vs-trl-")
    try:
        model_dir = case_model(c, work)
        params = sum(
            p.numel() for p in transformers.AutoModelForImageTextToText.from_pretrained(model_dir).parameters()
        )
        print(
            f"case {args.case!r}: {model_name(c)}, {params / 1e6:.2f}M params float32; {c['prompts']} prompts x "
            f"{c['generations']} generations x {c['new_tokens']} new tokens, {c['image_size']}px pictures, "
            f"lr {c['lr']}, {c['steps']} steps (first = warm-up), {args.ranks} rank(s)/thread(s) each; "
            f"load average {os.getloadavg()[0]:.1f}",
            file=sys.stderr,
        )
        load = {"rlcore": os.getloadavg()[0]}
        rows = run_rlcore(model_dir, c, os.path.join(work, "rlcore"), args.ranks)
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
        f"{'rlcore (dtensor+vllm)':<22}{ours:>8.3f}{phases['generation']:>10.3f}{ours - phases['generation']:>8.3f}"
        f"{statistics.mean(gen_len):>10.1f}{rows[0]['reward_mean']:>10.3f}{rows[-1]['reward_mean']:>10.3f}"
    )
    trl_gen = median_after_warmup(trl_generate)
    trl_len = [log.get("completions/mean_length", float("nan")) for log in trl_logs[1:]] or [float("nan")]
    trl_reward = [log["reward"] for log in trl_logs] or [float("nan")]
    print(
        f"{'TRL GRPOTrainer':<22}{theirs:>8.3f}{trl_gen:>10.3f}{theirs - trl_gen:>8.3f}"
        f"{statistics.mean(trl_len):>10.1f}{trl_reward[0]:>10.3f}{trl_reward[-1]:>10.3f}"
    )
    print("rlcore phases (median s): " + ", ".join(f"{p} {v:.3f}" for p, v in phases.items()))
    print(
        f"per-step seconds: rlcore {[round(r['time/step_s'], 3) for r in rows]}, TRL {[round(s, 3) for s in trl_steps]}"
    )
    speedup = theirs / ours
    print(f"TRL / rlcore step time: {speedup:.2f}x (goal >= 2, issue 57)")
    result = {
        "rlcore_step_s": round(ours, 4),
        "trl_step_s": round(theirs, 4),
        "speedup": round(speedup, 2),
        "model": model_name(c),
        "model_params": params,
        "case": args.case,
        "prompts": c["prompts"],
        "generations": c["generations"],
        "new_tokens": c["new_tokens"],
        "image_size": c["image_size"],
        "steps": c["steps"],
        "ranks": args.ranks,
        "rlcore_phases_s": {p: round(v, 4) for p, v in phases.items()},
        "trl_generate_s": round(trl_gen, 4),
        "rlcore_steps_s": [round(r["time/step_s"], 4) for r in rows],
        "trl_steps_s": [round(s, 4) for s in trl_steps],
        "rlcore_lens": [round(r["mean_generation_length"], 1) for r in rows],
        "trl_lens": [round(log.get("completions/mean_length", float("nan")), 1) for log in trl_logs],
        "rlcore_mean_len": round(statistics.mean(gen_len), 1),
        "trl_mean_len": round(statistics.mean(trl_len), 1),
        "rlcore_reward": [round(rows[0]["reward_mean"], 3), round(rows[-1]["reward_mean"], 3)],
        "trl_reward": [round(trl_reward[0], 3), round(trl_reward[-1], 3)],
        "load": {k: round(v, 2) for k, v in load.items()},
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "versions": {
            "torch": __import__("torch").__version__,
            "transformers": transformers.__version__,
            "trl": __import__("trl").__version__,
        },
    }
    line = json.dumps(result)
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
