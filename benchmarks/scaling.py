"""How rlcore's cost grows with model size and sequence length (issue 13).

For every (backend, size, sequence length) case, in fresh processes:

- **time**: ``Policy.train`` (NLL loss, AdamW) and ``Policy.get_logprobs`` against a raw
  torch multiprocess script of the same step — exactly the method and code of
  ``policy_overhead.py`` (its ``RawRunner`` / ``_raw_rank`` / ``PolicyRunner.run`` are
  imported, not copied), with its module constants (sequence length, rows per rank) set per
  case in the driver and in every raw rank, and ``torch.optim.SGD`` replaced by
  ``torch.optim.AdamW`` inside the raw ranks so both sides keep Adam state. Repeats are
  interleaved; medians are reported as tokens/s (valid tokens of the whole batch / seconds).
- **memory**: peak resident memory (``VmHWM`` from ``/proc/<pid>/status``) of each rlcore
  worker and of each raw rank, read after the repeats; the table shows the largest rank.
  ``init GB`` is the rlcore workers' peak right after ``Policy(...)`` returned (model loaded,
  sharded, reference copy taken, nothing run yet).
  ``theory`` per rank is

      runtime + (4 B params + 4 B grads + 8 B Adam m, v) * P / shard
              + 4 B * P / shard for the reference copy (when ``--reference``)
              + activations

  where ``shard`` is the data-parallel size for dtensor (FSDP2) and fsdp1 (FULL_SHARD) and 1
  for megatron (tp=pp=1 with ``use_distributed_optimizer: false``, the only choice on CPU:
  every rank holds full params, a full fp32 grad buffer and full Adam state). The reference
  copy is each rank's own shard on CPU (``_snapshot_to_cpu`` of every backend), so it divides
  by the same ``shard``. ``runtime`` is a raw rank's RSS after importing torch and
  transformers, and ``activations`` is the raw rank's peak minus runtime minus its own states
  (for dtensor the raw side is FSDP2 too; otherwise a full replica) — i.e. what the same step
  needs beyond its states, measured, not modelled. ``mem/theory`` > 1 is memory rlcore holds
  that the plain script does not.

Model sizes are scaled-down presets (real architecture, random fp32 weights): see ``SIZES``.

    python benchmarks/scaling.py --quick
    python benchmarks/scaling.py --backends dtensor,megatron --sizes 10m,50m --seq-lens 256,1024

The last line printed is JSON: ``largest_params``, ``max_memory_vs_theory``,
``max_overhead_vs_raw`` (rlcore seconds / raw seconds of train + logprobs),
``max_refit_vs_floor`` (null: refit is not measured by this script yet) and ``cases``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Iterator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import policy_overhead as po  # noqa: E402  (the sibling benchmark whose method this reuses)

_QWEN = "qwen2.5-0.5b"
_SMALL_QWEN = dict(vocab_size=32000, max_position_embeddings=4096)
#: name -> (preset, overrides). ~10M and ~50M use a 32k vocabulary (else the 151,936-row embedding
#: alone is 136M); "150m" is the 0.5B preset cut to 2 layers, "0.5b" and "1b" are the real shapes.
SIZES: dict[str, tuple[str, dict]] = {
    "10m": (_QWEN, dict(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64,
                        intermediate_size=1024, **_SMALL_QWEN)),
    "50m": (_QWEN, dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=2, head_dim=64,
                        intermediate_size=2048, **_SMALL_QWEN)),
    "150m": (_QWEN, dict(num_layers=2)),
    "0.5b": (_QWEN, {}),
    "1b": ("llama-3.2-1b", {}),
}
QUICK = dict(sizes="10m,50m,150m", seq_lens="256", repeats=2, rows_per_rank=1)
FULL = dict(sizes="10m,50m,150m,0.5b", seq_lens="256,1024,2048", repeats=3, rows_per_rank=2)
SHARDED = {"dtensor": True, "fsdp1": True, "megatron": False}
STATE_BYTES = 4 + 4 + 8  # fp32 params, grads, Adam m and v
GB = 1e9


# --------------------------------------------------------------------------- small helpers


def status_kb(pid: int | str, field: str) -> int:
    """One ``kB`` field (VmHWM, VmRSS) of /proc/<pid>/status, in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def model_dir_for(size: str) -> tuple[str, int]:
    """Build (once, cached) the model of ``size``; returns its directory and parameter count."""
    from rlcore.models import tiny_model_path
    from rlcore.models.presets import preset

    name, overrides = SIZES[size]
    path = tiny_model_path(**preset(name, **overrides))
    return path, count_params(path)


def count_params(model_dir: str) -> int:
    """Parameters of the model (tied embeddings once), counted on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return sum(p.numel() for p in model.parameters())


def configure(settings: dict) -> None:
    """Set policy_overhead's module constants (this process) to one case's values."""
    for key, value in settings.items():
        if key.isupper():
            setattr(po, key, value)


@contextlib.contextmanager
def patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


# --------------------------------------------------------------------------- raw side


def _scaled_raw_rank(settings: dict, rank: int, *args: Any) -> None:
    """policy_overhead's raw rank with this case's constants and AdamW; records its runtime RSS first."""
    import torch
    import transformers  # noqa: F401
    from transformers import AutoModelForCausalLM  # noqa: F401  (resolve the lazy import now)

    configure(settings)
    with open(f"{settings['baseline_file']}.{rank}", "w") as f:
        f.write(str(status_kb("self", "VmRSS")))
    torch.optim.SGD = torch.optim.AdamW  # this process only: both sides keep Adam state
    po._raw_rank(rank, *args)


def start_raw(model_dir: str, world_size: int, backend: str, settings: dict) -> po.RawRunner:
    """policy_overhead.RawRunner, its ranks running :func:`_scaled_raw_rank`."""
    with patched(po, "_raw_rank", functools.partial(_scaled_raw_rank, settings)):
        return po.RawRunner(model_dir, world_size, fsdp2=backend == "dtensor")


def raw_baseline(settings: dict, world_size: int) -> int:
    """The largest raw rank's RSS after importing torch and transformers (the 'runtime' term)."""
    values = []
    for rank in range(world_size):
        with open(f"{settings['baseline_file']}.{rank}") as f:
            values.append(int(f.read()))
    return max(values)


# --------------------------------------------------------------------------- rlcore side


class ScaledPolicyRunner(po.PolicyRunner):
    """policy_overhead.PolicyRunner (same run/close) with AdamW, a per-case length and the reference copy."""

    def __init__(self, backend: str, model_dir: str, world_size: int, reference: bool) -> None:
        from rlcore.algorithms.loss_functions import NLLLoss
        from rlcore.config import load_config_dict
        from rlcore.data import BatchedDataDict
        from rlcore.distributed import RayVirtualCluster, init_ray
        from rlcore.policy import Policy
        from rlcore.testing.models import build_tiny_tokenizer

        init_ray(num_cpus=max(world_size, 2))
        cfg = load_config_dict({"cluster": {"workers_per_node": world_size},
                                "policy": policy_config(backend, model_dir, world_size)}).policy
        self.cluster = RayVirtualCluster([world_size])
        self.policy = Policy(self.cluster, cfg, build_tiny_tokenizer(), init_reference_model=reference)
        self.data = BatchedDataDict(po.make_data(world_size))
        self.loss_fn = NLLLoss()

    def close(self) -> None:
        """Stop the workers and the cluster; Ray itself stays up for the next case (see main)."""
        self.policy.shutdown()
        self.cluster.shutdown()

    def peak_rss(self) -> list[int]:
        return [status_kb(pid, "VmHWM") for pid in self.policy.worker_group.worker_pids()]


def policy_config(backend: str, model_dir: str, world_size: int) -> dict:
    """policy_overhead's policy config with AdamW (megatron: its own adam, undistributed)."""
    cfg = {"backend": backend, "model_name": model_dir,
           "train_global_batch_size": po.ROWS_PER_RANK * world_size, "train_micro_batch_size": po.MICRO_BATCH,
           "logprob_batch_size": po.LOGPROB_BATCH, "learning_rate": po.LR,
           "optimizer": {"name": "torch.optim.AdamW", "kwargs": {"lr": po.LR}}, "max_grad_norm": None,
           "precision": "float32", "max_total_sequence_length": po.SEQ_LEN}
    if backend == "megatron":
        cfg["megatron_cfg"] = {"enabled": True, "optimizer": {"optimizer": "adam", "use_distributed_optimizer": False}}
        cfg["dtensor_cfg"] = {"enabled": False}
    return cfg


# --------------------------------------------------------------------------- one case


def time_interleaved(raw: Any, ours: Any, repeats: int) -> dict[str, dict[str, list[float]]]:
    """One warm-up of each, then ``repeats`` interleaved rounds (as policy_overhead.main does)."""
    times: dict[str, dict[str, list[float]]] = {s: {"train": [], "logprobs": []} for s in ("raw", "rlcore")}
    for command in ("train", "logprobs"):
        raw.run(command)
        ours.run(command)
    for _ in range(repeats):
        for command in ("train", "logprobs"):
            for side, runner in (("raw", raw), ("rlcore", ours)):
                times[side][command].append(runner.run(command)[0])
    return times


def run_case(backend: str, size: str, seq_len: int, args: argparse.Namespace, tmp: str) -> dict:
    """Time and measure one case in fresh raw ranks and fresh rlcore workers."""
    model_dir, n_params = model_dir_for(size)
    settings = dict(SEQ_LEN=seq_len, ROWS_PER_RANK=args.rows_per_rank,
                    LOGPROB_BATCH=min(po.LOGPROB_BATCH, args.rows_per_rank),
                    baseline_file=os.path.join(tmp, f"{backend}-{size}-{seq_len}"))
    configure(settings)
    ws = args.world_size
    raw = start_raw(model_dir, ws, backend, settings)
    try:
        ours = ScaledPolicyRunner(backend, model_dir, ws, args.reference)
        try:
            init_peak = max(ours.peak_rss())  # model loaded, sharded, reference copied; nothing run
            times = time_interleaved(raw, ours, args.repeats)
            our_peak = max(ours.peak_rss())
            raw_peak = max(status_kb(pid, "VmHWM") for pid in raw.context.pids())
            tokens = int(ours.data["input_lengths"].sum())
        finally:
            ours.close()
    finally:
        raw.close()
    row = summarise(backend, size, seq_len, n_params, tokens, times, our_peak, raw_peak,
                    raw_baseline(settings, ws), args)
    return dict(row, init_peak_gb=init_peak / GB)


def summarise(backend: str, size: str, seq_len: int, n_params: int, tokens: int, times: dict,
              our_peak: int, raw_peak: int, runtime: int, args: argparse.Namespace) -> dict:
    """Throughputs, ratios and the memory theory of one case."""
    med = statistics.median
    shard = args.world_size if SHARDED[backend] else 1
    raw_shard = args.world_size if backend == "dtensor" else 1  # the raw script's own sharding
    activations = max(raw_peak - runtime - STATE_BYTES * n_params / raw_shard, 0)
    reference = 4 * n_params / shard if args.reference else 0
    theory = runtime + STATE_BYTES * n_params / shard + reference + activations
    ours_s = med([a + b for a, b in zip(times["rlcore"]["train"], times["rlcore"]["logprobs"])])
    raw_s = med([a + b for a, b in zip(times["raw"]["train"], times["raw"]["logprobs"])])
    return dict(backend=backend, size=size, params=n_params, seq_len=seq_len, tokens=tokens,
                train_tok_s=tokens / med(times["rlcore"]["train"]), raw_train_tok_s=tokens / med(times["raw"]["train"]),
                lp_tok_s=tokens / med(times["rlcore"]["logprobs"]), raw_lp_tok_s=tokens / med(times["raw"]["logprobs"]),
                overhead=ours_s / raw_s, peak_gb=our_peak / GB, raw_peak_gb=raw_peak / GB, runtime_gb=runtime / GB,
                activations_gb=activations / GB, theory_gb=theory / GB, mem_vs_theory=our_peak / theory)


# --------------------------------------------------------------------------- output


COLUMNS = [("backend", "backend", "{}"), ("size", "size", "{}"), ("params", "params(M)", "{:.1f}"),
           ("seq_len", "seq", "{}"), ("train_tok_s", "train tok/s", "{:.0f}"), ("raw_train_tok_s", "raw", "{:.0f}"),
           ("lp_tok_s", "lp tok/s", "{:.0f}"), ("raw_lp_tok_s", "raw", "{:.0f}"), ("overhead", "t/raw", "{:.2f}"),
           ("init_peak_gb", "init GB", "{:.2f}"), ("peak_gb", "peak GB", "{:.2f}"), ("raw_peak_gb", "raw GB", "{:.2f}"), ("activations_gb", "act GB", "{:.2f}"),
           ("theory_gb", "theory GB", "{:.2f}"), ("mem_vs_theory", "mem/theory", "{:.2f}")]


def print_table(rows: list[dict]) -> None:
    cells = [[h for _, h, _ in COLUMNS]]
    for row in rows:
        values = dict(row, params=row["params"] / 1e6)
        cells.append([fmt.format(values[key]) for key, _, fmt in COLUMNS])
    widths = [max(len(r[i]) for r in cells) for i in range(len(COLUMNS))]
    for r in cells:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))


def summary_json(rows: list[dict]) -> dict:
    return {"largest_params": max((r["params"] for r in rows), default=0),
            "max_memory_vs_theory": round(max((r["mem_vs_theory"] for r in rows), default=0), 3),
            "max_overhead_vs_raw": round(max((r["overhead"] for r in rows), default=0), 3),
            "max_refit_vs_floor": None,
            "cases": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()} for r in rows]}


# --------------------------------------------------------------------------- main


@contextlib.contextmanager
def ray_session(world_size: int) -> Iterator[None]:
    """One Ray instance for all cases (each case still gets fresh worker processes)."""
    from rlcore.distributed import init_ray, shutdown_ray

    init_ray(num_cpus=max(world_size, 2))
    try:
        yield
    finally:
        shutdown_ray()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"sizes <= 150M, short lengths: {QUICK}")
    parser.add_argument("--backends", default="dtensor")
    parser.add_argument("--sizes", help=f"comma-separated names from {sorted(SIZES)}")
    parser.add_argument("--seq-lens")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rows-per-rank", type=int)
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--reference", action=argparse.BooleanOptionalAction, default=True,
                        help="build the reference model copy (init_reference_model)")
    args = parser.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():  # explicit options win
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import transformers

    transformers.utils.logging.disable_progress_bar()
    rows = []
    print(f"world size {args.world_size}, {args.rows_per_rank} rows/rank, {args.repeats} repeats after 1 warm-up, "
          f"reference copy {args.reference}, load average {os.getloadavg()}", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp, ray_session(args.world_size):
        for backend in args.backends.split(","):
            for size in args.sizes.split(","):
                for seq_len in map(int, args.seq_lens.split(",")):
                    t0 = time.perf_counter()
                    rows.append(run_case(backend, size, seq_len, args, tmp))
                    print(f"{backend} {size} {seq_len}: {time.perf_counter() - t0:.0f}s, "
                          f"load {os.getloadavg()[0]:.2f}", file=sys.stderr)
    print_table(rows)
    print(json.dumps(summary_json(rows)))


if __name__ == "__main__":
    main()
