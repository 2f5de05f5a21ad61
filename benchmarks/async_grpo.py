"""Synchronous, one-step-off and in-flight GRPO: the same run, generation on its own core, side by side.

The runs are ``rlcore run`` on ``examples/grpo_async_tiny.yaml``'s layout: one
CPU worker trains (dtensor), a vLLM engine on the other generates. They differ
in how generation and training overlap:

- ``sync``: ``grpo.async_grpo.enabled: false``; the engine and the trainer take
  turns (step = refit + generation + logprobs + train);
- ``one_step_off``: async GRPO with whole-batch engine calls; the engine
  generates the next rollout while the trainer trains, on weights one step older
  (``max_trajectory_age_steps: 1``, importance-weighted), and a refit waits for
  the rollout in flight to end;
- ``in_flight``: the same with ``vllm_cfg.async_engine: true`` and
  ``grpo.async_grpo.in_flight_weight_updates: true``: the engine serves sample
  groups continuously and a refit lands between two engine steps while requests
  run (``keep`` pause), so neither side waits for the other's tail.

For each: the median step time, the engine's busy fraction (the loop's
``async/engine_busy_fraction`` where it reports one, else generation time over
step time) and the ratio of the step to its overlap floor
``max(generation, logprobs + train + refit)``: generation is the synchronous
run's (one whole-batch call on an engine doing nothing else), the trainer's
phases each mode's own medians (goal for ``in_flight``: busy fraction >= 0.95,
floor ratio <= 1.05). And the CPU floor: the engine's, the trainer's and the driver's CPU seconds per
step together over the cores, what no overlap can beat where the three share the cores.

    python benchmarks/async_grpo.py                    # tiny-llama, 16 prompts x 4, 32 new tokens, 20 steps
    python benchmarks/async_grpo.py --model 10m --new-tokens 48 --steps 12   # training-bound: less to overlap
    python benchmarks/async_grpo.py --max-age 2        # two rollouts generated while one trains

Step time is the loop's ``time/step_s`` (async: wall time from waiting for the
rollout to the next refit), median over the steps after ``--warmup``. The
last line printed is JSON: ``async_vs_sync`` (median one-step-off step / median
sync step; goal <= 0.65), ``in_flight_vs_one_step_off``, every mode's medians,
busy fraction, floor ratio, and first and last mean reward.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
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


#: The overrides of each mode, on top of the example's (which is asynchronous).
MODES: dict[str, list[str]] = {
    "sync": ["grpo.async_grpo.enabled=false"],
    "one_step_off": ["grpo.async_grpo.enabled=true"],
    "in_flight": [
        "grpo.async_grpo.enabled=true",
        "policy.generation.vllm_cfg.async_engine=true",
        "grpo.async_grpo.in_flight_weight_updates=true",
    ],
}


class WorkerCpu(threading.Thread):
    """Samples, every ``period_s``, the CPU seconds (user + system, from ``/proc``) of this process's Ray
    workers (its descendants titled ``ray::WorkerHost``): the engines' (processes that mapped vLLM's files) and
    the trainers', beside the steps the run's metrics file holds by then. CPU time, unlike wall time, is barely
    changed by other processes sharing the cores, so the engine's CPU per step compares runs made under other
    loads."""

    def __init__(self, metrics_path: str, period_s: float = 0.1, discover_s: float = 2.0) -> None:
        super().__init__(daemon=True, name="worker-cpu")
        self.metrics_path, self.period_s, self.discover_s = metrics_path, period_s, discover_s
        self.samples: list[tuple[int, float, float, float]] = []  # (steps logged, engine, trainer, driver cpu s)
        self._latest: dict[int, float] = {}  # pid -> cpu s (a worker that ended keeps its last)
        self._workers: set[int] = set()
        self._engines: set[int] = set()
        self._discovered_at = float("-inf")
        self._steps, self._read_to = 0, 0  # steps logged so far, and how far the metrics file was read
        self._done = threading.Event()
        self._tick = os.sysconf("SC_CLK_TCK")

    def run(self) -> None:
        while not self._done.wait(self.period_s):
            self._sample()

    def stop(self) -> None:
        self._done.set()
        self.join()
        self._sample()

    def _discover(self) -> None:
        """Find the Ray workers (a walk of /proc: every ``discover_s``, not every sample, so that the sampler
        itself takes little of the two cores the run shares)."""
        for pid in _descendants(os.getpid()):
            if pid in self._engines:
                continue
            try:
                if pid not in self._workers:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        if not f.read().startswith(b"ray::WorkerHost"):
                            continue
                    self._workers.add(pid)
                with open(f"/proc/{pid}/maps") as f:  # again at each walk: an engine maps vLLM once it imports it
                    if "/vllm/" in f.read():
                        self._engines.add(pid)
            except OSError:  # gone meanwhile
                continue
        self._discovered_at = time.monotonic()

    def _sample(self) -> None:
        if time.monotonic() - self._discovered_at >= self.discover_s:
            self._discover()
        for pid in self._workers:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:  # ended: it keeps its last
                continue
            self._latest[pid] = (int(fields[11]) + int(fields[12])) / self._tick
        try:
            with open(self.metrics_path, "rb") as f:
                f.seek(self._read_to)
                new = f.read()
        except OSError:
            new = b""
        complete = new[: new.rfind(b"\n") + 1]
        self._steps += complete.count(b'"time/step_s"')
        self._read_to += len(complete)
        engine = sum(cpu for pid, cpu in self._latest.items() if pid in self._engines)
        trainer = sum(cpu for pid, cpu in self._latest.items() if pid not in self._engines)
        self.samples.append((self._steps, engine, trainer, time.process_time()))  # the driver: this process

    def per_step(self, first: int, last: int) -> tuple[float, float, float]:
        """Engine, trainer and driver CPU seconds per step from step ``first`` logged to step ``last`` logged."""
        nan = (float("nan"),) * 3
        at = {mark: next((cpu for steps, *cpu in self.samples if steps >= mark), nan) for mark in (first, last)}
        count = max(last - first, 1)
        engine, trainer, driver = ((b - a) / count for a, b in zip(at[first], at[last]))
        return engine, trainer, driver


def _descendants(root: int) -> list[int]:
    """Every process below ``root`` (Ray's raylet, and its workers, are started by the driver)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def run(model_dir: str, args: argparse.Namespace, mode: str, out_dir: str) -> list[dict[str, Any]]:
    """One ``rlcore run`` in ``mode``; its per-step metrics rows, each with the run's engine and trainer CPU
    seconds per step (after ``--warmup``) as ``cpu/engine_s`` and ``cpu/trainer_s``, and this process's (the
    driver's: the loop, the rollout threads, rewards) as ``cpu/driver_s``."""
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
            *MODES[mode],
            *([f"grpo.async_grpo.max_trajectory_age_steps={args.max_age}"] if mode != "sync" else []),
            f"logger.output_dir={out_dir}",
            "logger.progress_bar=false",
            "logger.tensorboard=false",
            "checkpointing.enabled=false",
        ],
    )
    cpu = WorkerCpu(os.path.join(out_dir, "metrics.jsonl"))
    cpu.start()
    try:
        rows = read_metrics(train(cfg)["metrics"])
    finally:
        cpu.stop()
    engine, trainer, driver = cpu.per_step(args.warmup, len(rows))
    return [{**row, "cpu/engine_s": engine, "cpu/trainer_s": trainer, "cpu/driver_s": driver} for row in rows]


def median(rows: list[dict[str, Any]], key: str, warmup: int) -> float:
    values = [r[key] for r in rows[warmup:] if key in r]
    return statistics.median(values) if values else float("nan")


def summary(rows: list[dict[str, Any]], warmup: int) -> dict[str, float]:
    """A mode's medians, its engine busy fraction and its step over the overlap floor."""
    out = {
        "step_s": median(rows, "time/step_s", warmup),
        **{key.removeprefix("time/"): median(rows, key, warmup) for key in PHASES},
        "first_reward": rows[0]["reward_mean"],
        "last_reward": rows[-1]["reward_mean"],
        "max_age": max(r.get("async/age_max", 0.0) for r in rows),
        "engine_cpu_s": rows[-1]["cpu/engine_s"],
        "trainer_cpu_s": rows[-1]["cpu/trainer_s"],
        "driver_cpu_s": rows[-1]["cpu/driver_s"],
    }
    out["trainer_s"] = sum(0.0 if out[k] != out[k] else out[k] for k in ("logprob_s", "train_s", "refit_s"))  # nan: 0
    busy = median(rows, "async/engine_busy_fraction", warmup)
    out["engine_busy_fraction"] = busy if busy == busy else out["generation_s"] / out["step_s"]
    out["engine_s"] = out["engine_busy_fraction"] * out["step_s"]  # engine time per step
    return out


def add_floors(results: dict[str, dict[str, float]]) -> None:
    """Each mode's overlap floor ``max(generation, logprobs + train + refit)``. Generation is the synchronous
    run's whole-batch call on an engine that does nothing else (the least one rollout costs the engine) where
    that run was made, else the mode's own ``time/generation_s`` (which, with rollouts generated side by side,
    is their overlapping wall time, not the engine's cost: a floor too high).

    Beside it, the CPU floor: the CPU seconds a step took in the engine, the trainer and the driver together,
    over the machine's cores. Where the three share the cores (this machine: 2), no overlap beats it, and the
    overlap floor, which gives the engine and the trainer a core each and the driver none, is out of reach."""
    generation = results["sync"]["generation_s"] if "sync" in results else None
    cores = os.cpu_count() or 1
    for r in results.values():
        r["floor_s"] = max(r["generation_s"] if generation is None else generation, r["trainer_s"])
        r["floor_ratio"] = r["step_s"] / r["floor_s"]
        r["cpu_floor_s"] = (r["engine_cpu_s"] + r["trainer_cpu_s"] + r["driver_cpu_s"]) / cores
        r["cpu_floor_ratio"] = r["step_s"] / r["cpu_floor_s"]


def engine_calls(model_dir: str, args: argparse.Namespace) -> None:
    """What one rollout (``--prompts`` groups of ``--generations`` samples, ``--new-tokens`` tokens, sampled)
    costs the engine, submitted each way in turn ``--engine-calls`` times on the same two engines: the engine
    process's CPU seconds and the wall time, medians (after two warm-up rounds)."""
    import torch
    from transformers import AutoTokenizer

    from rl_vllm.generation import VllmGeneration
    from rlcore.config import load_config_dict
    from rlcore.data import BatchedDataDict
    from rlcore.distributed import RayVirtualCluster, init_ray, shutdown_ray

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pad, vocab = tokenizer.pad_token_id, len(tokenizer)

    def config(async_engine: bool) -> Any:
        vllm_cfg = {"kv_cache_space_gb": 0.25, "max_model_len": args.new_tokens + 32, "async_engine": async_engine}
        generation = {"backend": "vllm", "max_new_tokens": args.new_tokens, "temperature": 1.0, "pad_token_id": pad}
        policy = {"backend": "reference", "model_name": model_dir, "generation": {**generation, "vllm_cfg": vllm_cfg}}
        return load_config_dict({"policy": policy}).policy.generation

    g = torch.Generator().manual_seed(0)
    n = args.generations
    groups = [
        BatchedDataDict(
            input_ids=torch.randint(3, vocab, (12,), generator=g).repeat(n, 1),
            input_lengths=torch.full((n,), 12),
            sampling_seeds=torch.arange(n) + n * i,
        )
        for i in range(args.prompts)
    ]
    whole = BatchedDataDict.from_batches(groups)
    tick = os.sysconf("SC_CLK_TCK")

    def cpu(pid: int) -> float:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / tick

    init_ray()
    clusters = [RayVirtualCluster([1], max_colocated_worker_groups=2) for _ in range(2)]
    engines: list[VllmGeneration] = []
    try:
        engines.append(VllmGeneration(clusters[0], config(False), name_prefix="bench-sync-vllm"))
        engines.append(VllmGeneration(clusters[1], config(True), name_prefix="bench-async-vllm"))
        sync, served = engines
        ways = {
            "one generate, sync engine": (sync, lambda: sync.generate(whole)),
            "one call, async_engine": (served, lambda: served.collect(served.generate_async(whole))),
            "a call per group": (served, lambda: list(served.as_completed([served.generate_async(b) for b in groups]))),
            "one streaming call": (served, lambda: list(served.as_completed(served.generate_groups_async(groups)))),
        }
        for _ in range(2):
            for _, call in ways.values():
                call()
        measured: dict[str, tuple[list[float], list[float]]] = {way: ([], []) for way in ways}
        for _ in range(args.engine_calls):
            for way, (engine, call) in ways.items():
                pid = engine.engine_info[0]["pid"]
                before, started = cpu(pid), time.perf_counter()
                call()
                measured[way][0].append(cpu(pid) - before)
                measured[way][1].append(time.perf_counter() - started)
        print(f"one rollout of {args.prompts}x{n} samples, {args.new_tokens} tokens; load {os.getloadavg()[0]:.1f}")
        for way, (cpu_s, wall_s) in measured.items():
            print(f"{way:28} engine cpu {statistics.median(cpu_s):.3f} s   wall {statistics.median(wall_s):.3f} s")
    finally:
        for engine in engines:
            engine.shutdown()
        for cluster in clusters:
            cluster.shutdown()
        shutdown_ray()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-llama", help=f"a built-in model name, or one of {sorted(SIZES)}")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the medians")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument(
        "--max-age",
        type=int,
        default=1,
        help="the asynchronous modes' grpo.async_grpo.max_trajectory_age_steps (1: the example's, and most of "
        "NeMo-RL's in-flight recipes'): how many rollouts may be in flight while one trains",
    )
    parser.add_argument("--modes", nargs="+", choices=sorted(MODES), default=list(MODES))
    parser.add_argument(
        "--engine-calls",
        type=int,
        default=0,
        help="instead: what one rollout costs the engine, submitted each way (one call, a call per sample group, "
        "one streaming call), this many times",
    )
    args = parser.parse_args(argv)

    from rlcore.models import resolve_model

    model_dir = model_dir_for(args.model)[0] if args.model in SIZES else resolve_model(args.model)
    if args.engine_calls:
        engine_calls(model_dir, args)
        return
    load = os.getloadavg()[0]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes:
            results[mode] = summary(run(model_dir, args, mode, os.path.join(tmp, mode)), args.warmup)
    add_floors(results)
    print(
        f"model {args.model}, {args.prompts}x{args.generations} rollouts of {args.new_tokens} new tokens, "
        f"{args.steps} steps (medians after {args.warmup}), max age {args.max_age}, load {load:.1f}"
    )
    print(
        f"{'':13}{'step s':>8}{'gen s':>8}{'engine s':>9}{'train s':>9}{'refit s':>9}{'wait s':>8}{'idle s':>8}"
        f"{'busy':>7}{'/floor':>8}{'eng cpu':>8}{'trn cpu':>8}{'drv cpu':>8}{'/cpu fl':>8}{'reward':>14}"
    )
    if "sync" not in results:
        print("no sync run: each floor's generation is the mode's own gen s (rollouts side by side, too high)")
    for mode, r in results.items():
        print(
            f"{mode:13}{r['step_s']:>8.2f}{r['generation_s']:>8.2f}{r['engine_s']:>9.2f}{r['train_s']:>9.2f}"
            f"{r['refit_s']:>9.2f}"
            f"{r['generation_wait_s']:>8.2f}{r['generation_idle_s']:>8.2f}"
            f"{r['engine_busy_fraction']:>7.2f}{r['floor_ratio']:>8.2f}"
            f"{r['engine_cpu_s']:>8.2f}{r['trainer_cpu_s']:>8.2f}{r['driver_cpu_s']:>8.2f}{r['cpu_floor_ratio']:>8.2f}"
            f"{r['first_reward']:>7.2f}->{r['last_reward']:.2f}"
        )

    def ratio(a: str, b: str) -> float | None:
        return results[a]["step_s"] / results[b]["step_s"] if a in results and b in results else None

    print(
        json.dumps(
            {
                "async_vs_sync": ratio("one_step_off", "sync"),
                "in_flight_vs_one_step_off": ratio("in_flight", "one_step_off"),
                "in_flight_vs_sync": ratio("in_flight", "sync"),
                "model": args.model,
                "max_age": args.max_age,
                "load": load,
                "modes": results,
            }
        )
    )


if __name__ == "__main__":
    main()
