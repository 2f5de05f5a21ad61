"""DPO step time: rlcore's DPO loop (``rlcore run`` with a ``dpo`` section) vs TRL's ``DPOTrainer``, side by side.

The same model (a Llama built from a config), the same preference pairs in the
same order, the same token sequences, pairs per optimizer step, micro-batch
size (TRL: gradient accumulation up to the same total), learning rate
(constant, AdamW without weight decay), gradient clipping (1.0), loss
(sigmoid DPO on summed token log-ratios, beta), maximum length and number of
steps, through:

- **rlcore**: ``rlcore.run.train.train(cfg)`` with a ``dpo`` section:
  ``dtensor`` training on ``--ranks`` ranks (one torch thread each). Per step
  (:func:`rlcore.algorithms.dpo.loop.dpo_step`): encode the next pairs, reference
  logprobs from the frozen initial weights (one forward pass over the batch,
  every step), one optimizer step of ``DPOLossFn``. Step time is the loop's
  own ``time/step_s`` (data + logprob + train). Packing is rlcore's default
  for a run (``--packing``); both sequences of a pair always share a
  micro-batch.
- **TRL**: ``DPOTrainer`` in this process (``use_cpu=True``, ``--ranks`` torch
  threads, ``precompute_ref_log_probs=False``: like rlcore it runs the
  reference model every step, inside each micro-step), padded micro-batches of
  ``ranks x micro_batch`` pairs, gradient accumulation up to the step's pairs,
  sequential sampling. Step time is the wall time of one optimizer step
  (callback ``on_step_begin`` .. ``on_step_end``).

Same sequences: the pairs are encoded once with rlcore's own DPO encoder
(:func:`rlcore.algorithms.dpo.batches.dpo_batch`: the tiny tokenizer's chat template,
BOS, the response with the template's EOS plus a trained EOS) and handed to
TRL as plain text, the rendered context as ``prompt`` and the response as
``chosen`` / ``rejected`` (TRL appends the EOS itself). The script checks that
TRL's tokenized dataset is token-for-token rlcore's and prints the per-step
token counts of both (real tokens, and the padded tokens TRL's collator
builds).

Both sides get the same threads (default one: on this shared 2-core box a
2-thread torch process is badly hurt by other load, see ``grpo_vs_trl.py``).
The first step of each is a warm-up and is not counted; the median of the
rest is reported. The runs are sequential (rlcore first, ``--trl-first`` for
the other order), so other processes' load is not shared equally: wall times
on a busy box move by 2x and more. The script therefore also reports what each
step cost the cores, whatever the load took: the CPU seconds of rlcore's
training workers (all ranks; :class:`WorkerCpu`) and of TRL's process, mean
per step after the first. Their ratio is the steadier figure (rlcore's
driver, which encodes the batch, a few ms a step, is not counted).

Cases (``--case``):

- ``shaped`` (default): a ~50M-parameter Llama (``grpo_vs_trl.py``'s), 16
  pairs per step in micro-batches of 4, up to 256 tokens, generated "reverse
  the text" pairs with ragged lengths (text length long-tailed, mean ~30
  bytes; the rejected answer a cut of the chosen one), 5 steps;
- ``tiny``: ``examples/dpo_tiny.yaml``'s tiny-llama (~0.4M parameters) and its
  shipped data (``examples/data/preference_dpo.jsonl``: short answers of 1-12
  bytes after prompts of various lengths), 16 pairs per step in micro-batches
  of 4, 64 tokens, lr 1e-3, 10 steps.

Needs ``trl`` (``pip install trl==1.16.0``; not a dependency of rlcore).

    python benchmarks/dpo_vs_trl.py [--case shaped|tiny] [--ranks 1] [--steps N] [--pairs P]
        [--micro-batch M] [--packing auto|on|off] [--trl-first]

The last line printed is JSON: ``{"rlcore_step_s", "trl_step_s", "speedup", "model_params",
"pairs_per_step", "case", "load", "packing", "order", "rlcore_cpu_s", "trl_cpu_s",
"cpu_speedup", "rlcore_loss", "trl_loss", "rlcore_phases_s", "tokens_per_step",
"trl_padded_tokens_per_step", "same_tokens"}`` (speedup = trl / rlcore median wall time,
cpu_speedup the same for CPU seconds, goal >= 1.3x for ``shaped``; losses are [first step,
last step]; load is the 1-minute load average at the start of each side and at the end).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SHAPED_MODEL = dict(
    arch="llama",
    hidden_size=768,
    num_layers=8,
    num_heads=12,
    num_kv_heads=4,
    head_dim=64,
    intermediate_size=2048,
    max_position_embeddings=512,
)
SHIPPED_DATA = Path(__file__).resolve().parents[1] / "src" / "rlcore" / "examples" / "data" / "preference_dpo.jsonl"

CASES: dict[str, dict[str, Any]] = {
    "shaped": dict(model=SHAPED_MODEL, data="ragged", pairs=16, micro_batch=4, max_len=256, lr=5e-5, beta=0.1, steps=5),
    "tiny": dict(model="tiny-llama", data="shipped", pairs=16, micro_batch=4, max_len=64, lr=1e-3, beta=0.1, steps=10),
}


def median_after_warmup(values: list[float]) -> float:
    return statistics.median(values[1:] if len(values) > 1 else values)


# --------------------------------------------------------------------------- data


def ragged_pairs(n: int, mean_length: float = 30.0, cap: int = 100, seed: int = 0) -> list[dict[str, str]]:
    """``n`` "reverse the text" pairs with long-tailed lengths: the text has ~``mean_length`` bytes (at most
    ``cap``, so that a sequence fits 256 tokens of the byte tokenizer), the chosen answer is it reversed, the
    rejected one a random cut of that (1 byte up to all of it)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        length = min(cap, 1 + int(rng.expovariate(1 / mean_length)))
        text = "".join(rng.choice("abcdefgh ") for _ in range(length)).strip() or "a"
        answer = text[::-1]
        rows.append(
            {
                "id": f"ragged-{i}",
                "prompt": f"reverse {text}",
                "chosen": answer,
                "rejected": answer[: rng.randint(1, len(answer))] if len(answer) > 1 else answer + "x",
            }
        )
    return rows


def case_rows(c: dict[str, Any]) -> list[dict[str, str]]:
    """The pairs of the run, in order: exactly ``steps x pairs`` rows (both sides see each once)."""
    n = c["steps"] * c["pairs"]
    if c["data"] == "shipped":
        rows = [json.loads(line) for line in SHIPPED_DATA.read_text().splitlines() if line.strip()]
        if len(rows) < n:
            raise SystemExit(f"{SHIPPED_DATA} has {len(rows)} pairs, the run needs {n}")
        return rows[:n]
    return ragged_pairs(n)


# --------------------------------------------------------------------------- rlcore


def rlcore_config(
    model_dir: str,
    c: dict[str, Any],
    data_path: str,
    out_dir: str,
    ranks: int,
    packing: bool | None,
    reference_batches_per_swap: int | None = None,
) -> Any:
    from rlcore.config import load_config_dict

    return load_config_dict(
        {
            "cluster": {"workers_per_node": ranks},
            "policy": {
                "backend": "dtensor",
                "model_name": model_dir,
                "precision": "float32",
                "tokenizer": {"chat_template": "default"},  # the tiny tokenizer's own (dpo_tiny's)
                "train_global_batch_size": c["pairs"],
                "train_micro_batch_size": c["micro_batch"],  # pairs
                "logprob_batch_size": 2 * c["micro_batch"],  # sequences: a training micro-batch's rows
                "max_total_sequence_length": c["max_len"],
                "learning_rate": c["lr"],
                "max_grad_norm": 1.0,
                "optimizer": {"name": "torch.optim.AdamW", "kwargs": {"lr": c["lr"], "weight_decay": 0.0}},
                "sequence_packing": {"enabled": packing},
            },
            "dpo": {
                "max_num_steps": c["steps"],
                "max_num_epochs": None,
                "reference_policy_kl_penalty": c["beta"],
                "seed": 0,
                **({"reference_batches_per_swap": reference_batches_per_swap} if reference_batches_per_swap else {}),
            },
            "data": {"train": {"path": data_path}, "input_key": "prompt", "shuffle": False},
            "logger": {"output_dir": out_dir, "tensorboard": False, "progress_bar": False},
            "checkpointing": {"enabled": False},
        }
    )


def rlcore_sequences(cfg: Any, steps: int) -> list[list[tuple[list[int], list[int]]]]:
    """Per step, the ``(input ids, loss mask)`` rows rlcore's DPO step trains (chosen, rejected, chosen, ...)."""
    from rlcore.algorithms.dpo.batches import dpo_batch
    from rlcore.config import resolve
    from rlcore.run.build import load_run_data
    from rlcore.run.prompts import load_tokenizer

    resolved = resolve(cfg, run=True).config
    tokenizer = load_tokenizer(resolved)
    data = load_run_data(resolved, tokenizer)
    out = []
    for k in range(steps):
        batch = dpo_batch(data.train.batch(k), tokenizer, resolved)
        if float(batch["sample_mask"].min()) < 1:
            raise SystemExit(f"step {k}: a pair is longer than max_len; the two sides would cut it differently")
        out.append(
            [
                (batch["input_ids"][i, :n].tolist(), batch["token_mask"][i, :n].int().tolist())
                for i, n in enumerate(batch["input_lengths"].tolist())
            ]
        )
    return out


class WorkerCpu:
    """CPU seconds of this process's Ray training workers (``WorkerHost``, all ranks together) at each step end.

    A thread polls the run's ``metrics.jsonl`` (a row is written as a step ends) and the workers' CPU times every
    ``period`` seconds; ``per_step_after_warmup()`` is the workers' CPU from the end of the first step to the end of
    the last one, per step. It is what the step cost the ranks whatever other load took from the cores, to set
    beside TRL's process CPU time. Each step end is known to within ``period``.
    """

    def __init__(self, metrics_path: str, period: float = 0.05) -> None:
        import threading

        self.path, self.period = Path(metrics_path), period
        self.ends: list[float] = []  # worker CPU seconds when each step's row appeared
        self._procs: dict[int, Any] = {}
        self._seen: dict[int, float] = {}  # each worker's last CPU reading
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _cpu(self) -> float:
        import psutil

        me = psutil.Process()
        for child in me.children(recursive=True):
            if child.pid not in self._procs:
                try:
                    if "WorkerHost" in " ".join(child.cmdline()):
                        self._procs[child.pid] = child
                except psutil.Error:
                    continue
        for pid, proc in self._procs.items():
            try:
                times = proc.cpu_times()
                self._seen[pid] = times.user + times.system
            except psutil.Error:
                pass  # exited: its last reading stands
        return sum(self._seen.values())

    def _poll(self) -> None:
        while not self._stop.wait(self.period):
            try:
                rows = sum(1 for line in self.path.read_text().splitlines() if line.strip())
            except OSError:
                rows = 0
            cpu = self._cpu()
            while len(self.ends) < rows:
                self.ends.append(cpu)

    def __enter__(self) -> WorkerCpu:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def per_step_after_warmup(self) -> float | None:
        return (self.ends[-1] - self.ends[0]) / (len(self.ends) - 1) if len(self.ends) > 1 else None


def run_rlcore(cfg: Any, out_dir: str) -> tuple[list[dict[str, Any]], float | None]:
    """``rlcore run`` with this config; its per-step metrics rows and its workers' CPU seconds per step after the
    first (:class:`WorkerCpu`)."""
    from rlcore.run.metrics import read_metrics
    from rlcore.run.train import train

    with WorkerCpu(os.path.join(out_dir, "metrics.jsonl")) as cpu:
        rows = read_metrics(train(cfg)["metrics"])
    return rows, cpu.per_step_after_warmup()


# --------------------------------------------------------------------------- TRL


def trl_rows(tokenizer: Any, sequences: list[list[tuple[list[int], list[int]]]]) -> list[dict[str, str]]:
    """TRL's plain-text rows for rlcore's sequences: the context (mask 0) as ``prompt``, each response without
    its final EOS (TRL appends the EOS to a plain-text response)."""
    eos = tokenizer.eos_token_id
    rows = []
    for step in sequences:
        for chosen, rejected in zip(step[0::2], step[1::2]):
            texts = {}
            for name, (ids, mask) in (("chosen", chosen), ("rejected", rejected)):
                start = mask.index(1)
                assert ids[-1] == eos and all(mask[start:]), "a response ends the sequence and ends with EOS"
                texts["prompt"] = tokenizer.decode(ids[:start])
                texts[name] = tokenizer.decode(ids[start:-1])
            rows.append(texts)
    return rows


def run_trl(
    model_dir: str, c: dict[str, Any], rows: list[dict[str, str]], expected: list[list[int]], out_dir: str, ranks: int
) -> dict[str, Any]:
    """TRL's DPOTrainer on the same pairs; step seconds, losses, token counts and whether the tokens match."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from trl import DPOConfig, DPOTrainer

    torch.set_num_threads(ranks)
    micro = ranks * c["micro_batch"]  # pairs rlcore's ranks process per micro-step together
    args = DPOConfig(
        output_dir=out_dir,
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=c["pairs"] // micro,
        learning_rate=c["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        optim="adamw_torch",
        max_grad_norm=1.0,
        beta=c["beta"],
        loss_type=["sigmoid"],
        max_length=c["max_len"],
        precompute_ref_log_probs=False,
        max_steps=c["steps"],
        train_sampling_strategy="sequential",
        seed=0,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.steps: list[float] = []
            self.cpu: list[float] = []
            self.logs: list[dict[str, Any]] = []

        def on_step_begin(self, *a: Any, **kw: Any) -> None:
            self._t0, self._c0 = time.perf_counter(), time.process_time()

        def on_step_end(self, *a: Any, **kw: Any) -> None:
            self.steps.append(time.perf_counter() - self._t0)
            self.cpu.append(time.process_time() - self._c0)

        def on_log(self, *a: Any, logs: dict[str, Any] | None = None, **kw: Any) -> None:
            self.logs.append(dict(logs or {}))

    timer = StepTimer()
    trainer = DPOTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        callbacks=[timer],
    )
    trainer.remove_callback(PrinterCallback)
    # The same sequences as rlcore's, token for token?
    prepared = trainer.train_dataset
    got = []
    for row in prepared:
        got += [row["prompt_ids"] + row["chosen_ids"], row["prompt_ids"] + row["rejected_ids"]]
    same = got == expected
    # What the collator builds: padded rows x width, and the real tokens in them, per micro-batch.
    collate, batches = trainer.data_collator, []

    def counting_collator(examples: list[dict[str, Any]]) -> dict[str, Any]:
        out = collate(examples)
        batches.append((out["input_ids"].numel(), int(out["attention_mask"].sum())))
        return out

    trainer.data_collator = counting_collator
    trainer.train()
    losses = [log["loss"] for log in timer.logs if "loss" in log]
    per_step = c["pairs"] // micro
    steps = [batches[i : i + per_step] for i in range(0, per_step * c["steps"], per_step)]
    return {
        "steps": timer.steps,
        "cpu": timer.cpu,
        "loss": losses,
        "same_tokens": same,
        "mismatches": sum(a != b for a, b in zip(got, expected)) + abs(len(got) - len(expected)),
        "padded": [sum(p for p, _ in s) for s in steps],
        "real": [sum(r for _, r in s) for s in steps],
    }


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", choices=sorted(CASES), default="shaped")
    parser.add_argument("--steps", type=int, help="DPO steps of each run (the first is a warm-up)")
    parser.add_argument("--pairs", type=int, help="preference pairs per optimizer step")
    parser.add_argument("--micro-batch", type=int, help="pairs per micro-batch and rank")
    parser.add_argument("--ranks", type=int, default=1, help="rlcore ranks (one thread each) = TRL torch threads")
    parser.add_argument(
        "--trl-first",
        action="store_true",
        help="run TRL before rlcore (load drifts: rerun both ways to see the spread)",
    )
    parser.add_argument(
        "--packing",
        choices=("auto", "on", "off"),
        default="auto",
        help="rlcore's policy.sequence_packing.enabled (auto: its default, packing on dtensor)",
    )
    parser.add_argument(
        "--reference-batches-per-swap",
        type=int,
        help="rlcore's dpo.reference_batches_per_swap (default: its default; 1: a reference weight swap every step)",
    )
    parser.add_argument(
        "--rlcore-only",
        action="store_true",
        help="time rlcore alone (no trl needed): prints its median step time and phases as JSON",
    )
    args = parser.parse_args(argv)

    import transformers

    from rlcore.models import BUILTIN_MODELS
    from rlcore.testing.models import tiny_model_path

    c = dict(CASES[args.case])
    for key in ("steps", "pairs", "micro_batch"):
        if getattr(args, key) is not None:
            c[key] = getattr(args, key)
    if c["pairs"] % (args.ranks * c["micro_batch"]):
        raise SystemExit("--pairs must be a multiple of --ranks x --micro-batch")
    spec = BUILTIN_MODELS[c["model"]] if isinstance(c["model"], str) else c["model"]
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    import datasets

    datasets.disable_progress_bars()
    model_dir = tiny_model_path(**spec)
    params = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_pretrained(model_dir).parameters())
    print(
        f"case {args.case!r}: llama {spec}, {params / 1e6:.1f}M params float32; {c['pairs']} pairs per step in "
        f"micro-batches of {c['micro_batch']} x {args.ranks} rank(s), max {c['max_len']} tokens, lr {c['lr']}, "
        f"beta {c['beta']}, {c['steps']} steps (first = warm-up), {args.ranks} rank(s)/thread(s) each; data "
        f"{c['data']}; load average {os.getloadavg()[0]:.1f}",
        file=sys.stderr,
    )

    packing = {"auto": None, "on": True, "off": False}[args.packing]
    work = tempfile.mkdtemp(prefix="dpo-vs-trl-")
    try:
        data_path = os.path.join(work, "pairs.jsonl")
        Path(data_path).write_text("".join(json.dumps(r) + "\n" for r in case_rows(c)))
        cfg = rlcore_config(
            model_dir, c, data_path, os.path.join(work, "rlcore"), args.ranks, packing, args.reference_batches_per_swap
        )
        if args.rlcore_only:
            start = os.getloadavg()[0]
            metrics, _ = run_rlcore(cfg, os.path.join(work, "rlcore"))
            print(
                json.dumps(
                    {
                        "rlcore_step_s": round(median_after_warmup([r["time/step_s"] for r in metrics]), 3),
                        "rlcore_phases_s": {
                            p: round(median_after_warmup([r.get(f"time/{p}_s", 0.0) for r in metrics]), 3)
                            for p in ("data", "logprob", "train")
                        },
                        # the reference logprobs computed ahead land in the steps that swap (the first
                        # among them): the mean over all steps, warm-up included, counts them all
                        "mean_step_s_all": round(statistics.mean(r["time/step_s"] for r in metrics), 3),
                        "mean_logprob_s_all": round(statistics.mean(r.get("time/logprob_s", 0.0) for r in metrics), 3),
                        "steps_s": [round(r["time/step_s"], 3) for r in metrics],
                        "case": args.case,
                        "reference_batches_per_swap": cfg.dpo.reference_batches_per_swap,
                        "load": [round(start, 1), round(os.getloadavg()[0], 1)],
                    }
                )
            )
            return
        sequences = rlcore_sequences(cfg, c["steps"])
        tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
        rows = trl_rows(tokenizer, sequences)
        load: dict[str, float] = {}
        for side in ("trl", "rlcore") if args.trl_first else ("rlcore", "trl"):
            load[side] = os.getloadavg()[0]
            if side == "rlcore":
                metrics, rlcore_cpu = run_rlcore(cfg, os.path.join(work, "rlcore"))
            else:
                trl = run_trl(
                    model_dir,
                    c,
                    rows,
                    [ids for step in sequences for ids, _ in step],
                    os.path.join(work, "trl"),
                    args.ranks,
                )
        load["end"] = os.getloadavg()[0]
    finally:
        shutil.rmtree(work, ignore_errors=True)

    ours = median_after_warmup([r["time/step_s"] for r in metrics])
    theirs = median_after_warmup(trl["steps"])
    phases = {
        p: median_after_warmup([r.get(f"time/{p}_s", 0.0) for r in metrics]) for p in ("data", "logprob", "train")
    }
    tokens = [sum(len(ids) for ids, _ in step) for step in sequences]
    lengths = [len(ids) for step in sequences for ids, _ in step]
    response = [sum(mask) for step in sequences for _, mask in step]
    rl_loss = [metrics[0]["loss"], metrics[-1]["loss"]]
    trl_loss = [trl["loss"][0], trl["loss"][-1]] if trl["loss"] else [float("nan")] * 2
    first, second = ("trl", "rlcore") if args.trl_first else ("rlcore", "trl")
    names = {"rlcore": "rlcore", "trl": "TRL"}
    print(
        f"1-minute load average at the start of {names[first]} {load[first]:.1f}, of {names[second]} "
        f"{load[second]:.1f}, at the end {load['end']:.1f}"
    )
    print(
        f"sequences: {len(lengths)} ({len(lengths) // 2} pairs), length mean {statistics.mean(lengths):.1f} "
        f"(min {min(lengths)}, max {max(lengths)}), response mean {statistics.mean(response):.1f} "
        f"(min {min(response)}, max {max(response)}); TRL's tokens = rlcore's: "
        f"{'yes' if trl['same_tokens'] else 'NO, ' + str(trl['mismatches']) + ' sequences differ'}"
    )
    print(f"tokens per step: rlcore {tokens}; TRL real {trl['real']}, padded {trl['padded']}")
    print(f"{'median s per step':<24}{'step':>8}{'loss first':>12}{'loss last':>11}")
    print(f"{'rlcore (dtensor)':<24}{ours:>8.3f}{rl_loss[0]:>12.4f}{rl_loss[1]:>11.4f}")
    print(f"{'TRL DPOTrainer':<24}{theirs:>8.3f}{trl_loss[0]:>12.4f}{trl_loss[1]:>11.4f}")
    print("rlcore phases (median s): " + ", ".join(f"{p} {v:.3f}" for p, v in phases.items()))
    print(
        f"per-step seconds: rlcore {[round(r['time/step_s'], 3) for r in metrics]}, "
        f"TRL {[round(s, 3) for s in trl['steps']]}"
    )
    trl_cpu = statistics.mean(trl["cpu"][1:] or trl["cpu"])
    cpu_ratio = trl_cpu / rlcore_cpu if rlcore_cpu else float("nan")
    print(
        f"CPU seconds per step after the first (mean; what each side cost the cores, whatever the load took): "
        f"rlcore workers {rlcore_cpu or float('nan'):.3f}, TRL process {trl_cpu:.3f}; TRL / rlcore {cpu_ratio:.2f}x"
    )
    print(f"losses: rlcore {[round(r['loss'], 4) for r in metrics]}, TRL {[round(x, 4) for x in trl['loss']]}")
    speedup = theirs / ours
    goal = " (goal >= 1.3)" if args.case == "shaped" else ""
    print(f"TRL / rlcore step time: {speedup:.2f}x{goal}")
    print(
        json.dumps(
            {
                "rlcore_step_s": round(ours, 3),
                "trl_step_s": round(theirs, 3),
                "speedup": round(speedup, 2),
                "model_params": params,
                "pairs_per_step": c["pairs"],
                "case": args.case,
                "load": {k: round(v, 1) for k, v in load.items()},
                "packing": args.packing,
                "order": "trl-first" if args.trl_first else "rlcore-first",
                "rlcore_cpu_s": round(rlcore_cpu, 3) if rlcore_cpu else None,
                "trl_cpu_s": round(trl_cpu, 3),
                "cpu_speedup": round(cpu_ratio, 2),
                "rlcore_loss": [round(x, 4) for x in rl_loss],
                "trl_loss": [round(x, 4) for x in trl_loss],
                "rlcore_phases_s": {p: round(v, 3) for p, v in phases.items()},
                "tokens_per_step": round(statistics.mean(tokens)),
                "trl_padded_tokens_per_step": round(statistics.mean(trl["padded"])) if trl["padded"] else None,
                "same_tokens": trl["same_tokens"],
            }
        )
    )


if __name__ == "__main__":
    main()
