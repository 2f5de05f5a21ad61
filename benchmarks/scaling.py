"""How rlcore's cost grows with model size and sequence length (issue 13).

For every (backend, size, sequence length) case, in fresh processes:

- **time** (context for the memory figures; rlcore's step overhead against a raw loop is
  ``step_overhead.py``'s figure, not this one): ``Policy.train`` (NLL loss, AdamW) and
  ``Policy.get_logprobs`` tokens/s beside a raw torch multiprocess script of the same step
  (``raw_ranks.py``'s ``RawRunner`` / ``_raw_rank`` / ``PolicyRunner.run``), with its module
  constants (sequence length, rows per rank) set per case in the driver and in every raw rank,
  and ``torch.optim.SGD`` replaced by ``torch.optim.AdamW`` inside the raw ranks so both sides keep Adam state.
  The raw script
  shards with FSDP2 wherever the backend shards the states (dtensor, fsdp1's FULL_SHARD,
  megatron with ``--megatron-tp`` > 1) and is a full replica otherwise. Repeats are
  interleaved; medians are reported as tokens/s (valid tokens of the whole batch / seconds).
  Above ``APART_ABOVE`` parameters (``--apart``) the raw ranks run and exit before rlcore's
  workers start: both sides alive at 0.5B do not fit in 24 GB. Those timings are not
  interleaved (the table's ``apart`` column).
- **memory**: peak resident memory (``VmHWM`` from ``/proc/<pid>/status``) of each rlcore
  worker and of each raw rank, read after the repeats; the table shows the largest rank.
  ``init GB`` is the rlcore workers' peak right after ``Policy(...)`` returned (model loaded,
  sharded, reference copy taken, nothing run yet).
  ``theory`` per rank is

      runtime + (4 B params + 4 B grads + 8 B Adam m, v) * P / shard
              + 4 B * P / shard for the reference copy (when ``--reference``)
              + activations

  where ``shard`` is the data-parallel size for dtensor (FSDP2) and fsdp1 (FULL_SHARD) and
  the tensor-parallel size for megatron (``use_distributed_optimizer: false``, the only
  choice on CPU: every data-parallel rank holds its TP slice's params, fp32 grad buffer and
  Adam state in full). The reference copy is each rank's own shard on CPU
  (``_snapshot_to_cpu`` of every backend), so it divides by the same ``shard``. ``runtime``
  is a raw rank's RSS after importing torch and transformers, and ``activations`` is the raw
  rank's peak minus runtime minus its own states — i.e. what the same step needs beyond its
  states, measured, not modelled. ``mem/theory`` > 1 is memory rlcore holds that the plain
  script does not.
- **checkpoint** (``--save``): one ``Policy.save_checkpoint`` (HF weights + optimizer state)
  after the repeats, timed, with the workers' peak RSS during it (``VmHWM`` reset first
  through ``/proc/<pid>/clear_refs``): a save must not hold a full unsharded copy anywhere.
- **refit** (``--refit``): per size, ``refit.py --model-dir`` in its own process: one
  training rank (``--refit-backend``) refits a colocated and a separately placed vLLM engine,
  against the engine's own in-process reload of the same tensors (the floor).

Model sizes are scaled-down presets (real architecture, random fp32 weights): see ``SIZES``.

    python benchmarks/scaling.py --quick
    python benchmarks/scaling.py --backends dtensor,megatron --sizes 10m,50m --seq-lens 256,1024
    python benchmarks/scaling.py --backends megatron --megatron-tp 2 --sizes 0.5b --no-refit

The last line printed is JSON: ``largest_params``, ``max_memory_vs_theory``,
``max_refit_vs_floor`` (the larger of colocated / floor and collective / max(broadcast,
floor) over the sizes), ``cases`` and ``refit_cases``.
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
from collections.abc import Iterator
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import raw_ranks as po  # noqa: E402  (the raw ranks and Policy runner this measures)
from step_overhead import SIZES  # noqa: E402  (one list of model sizes for every benchmark)

QUICK = dict(sizes="10m,50m,150m", seq_lens="256", repeats=2, rows_per_rank=1)
FULL = dict(sizes="10m,50m,150m,0.5b", seq_lens="256,1024,2048", repeats=3, rows_per_rank=2)
#: ``--apart auto``: from this many parameters on, raw and rlcore run one after the other (memory).
APART_ABOVE = 200e6
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
    """Set raw_ranks' module constants (this process) to one case's values."""
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
    """raw_ranks' raw rank with this case's constants and AdamW; records its runtime RSS first."""
    import torch
    import transformers  # noqa: F401
    from transformers import AutoModelForCausalLM  # noqa: F401  (resolve the lazy import now)

    configure(settings)
    with open(f"{settings['baseline_file']}.{rank}", "w") as f:
        f.write(str(status_kb("self", "VmRSS")))
    torch.optim.SGD = torch.optim.AdamW  # this process only: both sides keep Adam state
    po._raw_rank(rank, *args)


def raw_is_sharded(backend: str, args: argparse.Namespace) -> bool:
    """The raw script shards (FSDP2) wherever rlcore's backend shards the states: dtensor, fsdp1
    (FULL_SHARD) and megatron with tensor parallelism; else it is a full replica per rank."""
    return backend != "megatron" or args.megatron_tp > 1


def start_raw(model_dir: str, world_size: int, sharded: bool, settings: dict) -> po.RawRunner:
    """raw_ranks.RawRunner, its ranks running :func:`_scaled_raw_rank`."""
    with patched(po, "_raw_rank", functools.partial(_scaled_raw_rank, settings)):
        return po.RawRunner(model_dir, world_size, fsdp2=sharded)


def raw_baseline(settings: dict, world_size: int) -> int:
    """The largest raw rank's RSS after importing torch and transformers (the 'runtime' term)."""
    values = []
    for rank in range(world_size):
        with open(f"{settings['baseline_file']}.{rank}") as f:
            values.append(int(f.read()))
    return max(values)


# --------------------------------------------------------------------------- rlcore side


class ScaledPolicyRunner(po.PolicyRunner):
    """raw_ranks.PolicyRunner (same run/close) with AdamW, a per-case length and the reference copy."""

    def __init__(self, backend: str, model_dir: str, world_size: int, reference: bool, megatron_tp: int) -> None:
        from rlcore.algorithms.sft.loss import NLLLoss
        from rlcore.config import load_config_dict
        from rlcore.data import BatchedDataDict
        from rlcore.distributed import RayVirtualCluster, init_ray
        from rlcore.policy import Policy
        from rlcore.testing.models import build_tiny_tokenizer

        init_ray(num_cpus=max(world_size, 2))
        cfg = load_config_dict(
            {
                "cluster": {"workers_per_node": world_size},
                "policy": policy_config(backend, model_dir, world_size, megatron_tp),
            }
        ).policy
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

    def reset_peak_rss(self) -> None:
        """Start each worker's VmHWM over at its current RSS (``/proc/<pid>/clear_refs``, same user)."""
        for pid in self.policy.worker_group.worker_pids():
            with open(f"/proc/{pid}/clear_refs", "w") as f:
                f.write("5")

    def save(self, directory: str) -> tuple[float, int]:
        """Seconds and the workers' peak RSS of one checkpoint save (weights + optimizer state)."""
        self.reset_peak_rss()
        t0 = time.perf_counter()
        self.policy.save_checkpoint(os.path.join(directory, "weights"), os.path.join(directory, "optimizer"))
        return time.perf_counter() - t0, max(self.peak_rss())


def policy_config(backend: str, model_dir: str, world_size: int, megatron_tp: int = 1) -> dict:
    """raw_ranks' policy config with AdamW (megatron: its own adam, undistributed, ``megatron_tp``)."""
    cfg = {
        "backend": backend,
        "model_name": model_dir,
        "train_global_batch_size": po.ROWS_PER_RANK * world_size,
        "train_micro_batch_size": po.MICRO_BATCH,
        "logprob_batch_size": po.LOGPROB_BATCH,
        "learning_rate": po.LR,
        "optimizer": {"name": "torch.optim.AdamW", "kwargs": {"lr": po.LR}},
        "max_grad_norm": None,
        "precision": "float32",
        "max_total_sequence_length": po.SEQ_LEN,
    }
    if backend == "megatron":
        cfg["megatron_cfg"] = {
            "enabled": True,
            "tensor_model_parallel_size": megatron_tp,
            "optimizer": {"optimizer": "adam", "use_distributed_optimizer": False},
        }
        cfg["dtensor_cfg"] = {"enabled": False}
    return cfg


# --------------------------------------------------------------------------- one case


def time_runs(runners: dict[str, Any], repeats: int) -> dict[str, dict[str, list[float]]]:
    """One warm-up of each runner, then ``repeats`` interleaved rounds (the raw side beside rlcore's)."""
    times: dict[str, dict[str, list[float]]] = {side: {"train": [], "logprobs": []} for side in runners}
    for command in ("train", "logprobs"):
        for runner in runners.values():
            runner.run(command)
    for _ in range(repeats):
        for command in ("train", "logprobs"):
            for side, runner in runners.items():
                times[side][command].append(runner.run(command)[0])
    return times


def measure_raw(model_dir: str, settings: dict, args: argparse.Namespace, sharded: bool) -> tuple[dict, int]:
    """The raw ranks alone: times and their largest peak RSS (``--apart``)."""
    raw = start_raw(model_dir, args.world_size, sharded, settings)
    try:
        times = time_runs({"raw": raw}, args.repeats)
        return times, max(status_kb(pid, "VmHWM") for pid in raw.context.pids())
    finally:
        raw.close()


def measure_ours(backend: str, model_dir: str, args: argparse.Namespace, tmp: str, raw: Any = None) -> dict[str, Any]:
    """rlcore's workers (interleaved with ``raw`` when given): times, peaks, one checkpoint save."""
    ours = ScaledPolicyRunner(backend, model_dir, args.world_size, args.reference, args.megatron_tp)
    try:
        init_peak = max(ours.peak_rss())  # model loaded, sharded, reference copied; nothing run
        times = time_runs({"rlcore": ours, **({"raw": raw} if raw else {})}, args.repeats)
        out = dict(
            times=times, init_peak=init_peak, peak=max(ours.peak_rss()), tokens=int(ours.data["input_lengths"].sum())
        )
        if raw is not None:
            out["raw_peak"] = max(status_kb(pid, "VmHWM") for pid in raw.context.pids())
        if args.save:
            with tempfile.TemporaryDirectory(dir=tmp) as ckpt:
                out["save_s"], out["save_peak"] = ours.save(ckpt)
        return out
    finally:
        ours.close()


def run_case(backend: str, size: str, seq_len: int, args: argparse.Namespace, tmp: str) -> dict:
    """Time and measure one case in fresh raw ranks and fresh rlcore workers.

    Interleaved (both sides alive, rounds alternating) unless the case is run
    ``--apart``: then the raw ranks run and exit before rlcore's workers start,
    so the two never share memory (the 0.5B cases on 24 GB).
    """
    model_dir, n_params = model_dir_for(size)
    settings = dict(
        SEQ_LEN=seq_len,
        ROWS_PER_RANK=args.rows_per_rank,
        LOGPROB_BATCH=min(po.LOGPROB_BATCH, args.rows_per_rank),
        baseline_file=os.path.join(tmp, f"{backend}-{size}-{seq_len}"),
    )
    configure(settings)
    sharded = raw_is_sharded(backend, args)
    apart = args.apart == "yes" or (args.apart == "auto" and n_params > APART_ABOVE)
    if apart:
        raw_times, raw_peak = measure_raw(model_dir, settings, args, sharded)
        ours = measure_ours(backend, model_dir, args, tmp)
        ours["times"].update(raw_times)
        ours["raw_peak"] = raw_peak
    else:
        raw = start_raw(model_dir, args.world_size, sharded, settings)
        try:
            ours = measure_ours(backend, model_dir, args, tmp, raw)
        finally:
            raw.close()
    row = summarise(
        backend,
        size,
        seq_len,
        n_params,
        ours["tokens"],
        ours["times"],
        ours["peak"],
        ours["raw_peak"],
        raw_baseline(settings, args.world_size),
        args,
    )
    row.update(
        init_peak_gb=ours["init_peak"] / GB,
        apart=apart,
        save_s=ours.get("save_s"),
        save_peak_gb=ours["save_peak"] / GB if "save_peak" in ours else None,
    )
    return row


def summarise(
    backend: str,
    size: str,
    seq_len: int,
    n_params: int,
    tokens: int,
    times: dict,
    our_peak: int,
    raw_peak: int,
    runtime: int,
    args: argparse.Namespace,
) -> dict:
    """Throughputs, ratios and the memory theory of one case."""
    med = statistics.median
    shard = args.megatron_tp if backend == "megatron" else args.world_size
    raw_shard = args.world_size if raw_is_sharded(backend, args) else 1  # the raw script's own sharding
    activations = max(raw_peak - runtime - STATE_BYTES * n_params / raw_shard, 0)
    reference = 4 * n_params / shard if args.reference else 0
    theory = runtime + STATE_BYTES * n_params / shard + reference + activations
    return dict(
        backend=backend,
        size=size,
        params=n_params,
        seq_len=seq_len,
        tokens=tokens,
        train_tok_s=tokens / med(times["rlcore"]["train"]),
        raw_train_tok_s=tokens / med(times["raw"]["train"]),
        lp_tok_s=tokens / med(times["rlcore"]["logprobs"]),
        raw_lp_tok_s=tokens / med(times["raw"]["logprobs"]),
        peak_gb=our_peak / GB,
        raw_peak_gb=raw_peak / GB,
        runtime_gb=runtime / GB,
        activations_gb=activations / GB,
        theory_gb=theory / GB,
        mem_vs_theory=our_peak / theory,
    )


# --------------------------------------------------------------------------- output


COLUMNS = [
    ("backend", "backend", "{}"),
    ("size", "size", "{}"),
    ("params", "params(M)", "{:.1f}"),
    ("seq_len", "seq", "{}"),
    ("train_tok_s", "train tok/s", "{:.0f}"),
    ("raw_train_tok_s", "raw", "{:.0f}"),
    ("lp_tok_s", "lp tok/s", "{:.0f}"),
    ("raw_lp_tok_s", "raw", "{:.0f}"),
    ("init_peak_gb", "init GB", "{:.2f}"),
    ("peak_gb", "peak GB", "{:.2f}"),
    ("raw_peak_gb", "raw GB", "{:.2f}"),
    ("activations_gb", "act GB", "{:.2f}"),
    ("theory_gb", "theory GB", "{:.2f}"),
    ("mem_vs_theory", "mem/theory", "{:.2f}"),
    ("save_s", "save s", "{:.1f}"),
    ("save_peak_gb", "save GB", "{:.2f}"),
    ("apart", "apart", "{}"),
]
REFIT_COLUMNS = [
    ("size", "size", "{}"),
    ("params", "params(M)", "{:.1f}"),
    ("bytes", "MB", "{:.0f}"),
    ("floor_s", "floor s", "{:.3f}"),
    ("colocated_s", "colocated s", "{:.3f}"),
    ("broadcast_s", "broadcast s", "{:.3f}"),
    ("collective_s", "collective s", "{:.3f}"),
    ("colocated_floor_s", "floor s (coloc)", "{:.3f}"),
    ("collective_floor_s", "floor s (coll)", "{:.3f}"),
    ("colocated_vs_floor", "coloc/floor", "{:.2f}"),
    ("collective_vs_floor", "coll/floor", "{:.2f}"),
    ("load_average", "load", "{:.1f}"),
]


def print_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    cells = [[h for _, h, _ in columns]]
    for row in rows:
        values = dict(row, params=row["params"] / 1e6, bytes=row.get("bytes", row.get("colocated_bytes", 0)) / 1e6)
        cells.append(["-" if values.get(key) is None else fmt.format(values[key]) for key, _, fmt in columns])
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    for r in cells:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))


def summary_json(rows: list[dict], refits: list[dict]) -> dict:
    def rounded(r: dict) -> dict:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}

    refit_ratios = [max(r["colocated_vs_floor"], r["collective_vs_floor"]) for r in refits]
    return {
        "largest_params": max((r["params"] for r in rows + refits), default=0),
        "max_memory_vs_theory": round(max((r["mem_vs_theory"] for r in rows), default=0), 3) if rows else None,
        "max_refit_vs_floor": max(refit_ratios) if refit_ratios else None,
        "cases": [rounded(r) for r in rows],
        "refit_cases": [rounded(r) for r in refits],
    }


# --------------------------------------------------------------------------- refit


def refit_case(size: str, args: argparse.Namespace) -> dict:
    """``refit.py`` on this size's model, in its own process (its own Ray, its in-process engine's memory
    returned on exit): a colocated and a collective refit into vLLM against the engine's own reload.
    Above ``APART_ABOVE`` parameters one process per transport (one engine fewer alive at a time)."""
    import subprocess

    model_dir, n_params = model_dir_for(size)
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "refit.py")
    rounds = ["colocated", "collective"] if n_params > APART_ABOVE else ["colocated,collective"]
    row: dict[str, Any] = dict(size=size, params=n_params)
    for transports in rounds:
        done = subprocess.run(
            [
                sys.executable,
                script,
                "--backend",
                args.refit_backend,
                "--model-dir",
                model_dir,
                "--repeats",
                str(args.repeats),
                "--transports",
                transports,
            ],
            stdout=subprocess.PIPE,
            text=True,
            check=True,
        )
        figures = json.loads(done.stdout.strip().splitlines()[-1])
        if len(rounds) > 1:  # each round's own floor, memcpy and broadcast: prefixed with its transport
            figures = {k if k.startswith(transports) else f"{transports}_{k}": v for k, v in figures.items()}
        row.update(figures)
    return row


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
    parser.add_argument("--backends", default="dtensor", help="comma-separated; empty: refit rows only")
    parser.add_argument("--sizes", help=f"comma-separated names from {sorted(SIZES)}")
    parser.add_argument("--seq-lens")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rows-per-rank", type=int)
    parser.add_argument("--repeats", type=int)
    parser.add_argument(
        "--reference",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="build the reference model copy (init_reference_model)",
    )
    parser.add_argument(
        "--megatron-tp",
        type=int,
        default=1,
        help="megatron's tensor_model_parallel_size (its optimizer cannot shard on CPU: "
        "2 fits the 0.5B preset on 24 GB)",
    )
    parser.add_argument(
        "--apart",
        choices=("auto", "yes", "no"),
        default="auto",
        help=f"raw and rlcore one after the other instead of interleaved (auto: above "
        f"{APART_ABOVE / 1e6:.0f}M parameters)",
    )
    parser.add_argument(
        "--save",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time one checkpoint save per case and its peak RSS",
    )
    parser.add_argument(
        "--refit",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="refit rows (refit.py per size: vLLM engines vs their own in-process reload)",
    )
    parser.add_argument("--refit-backend", default="dtensor")
    args = parser.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():  # explicit options win
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import transformers

    transformers.utils.logging.disable_progress_bar()
    rows, refits = [], []
    print(
        f"world size {args.world_size}, {args.rows_per_rank} rows/rank, {args.repeats} repeats after 1 warm-up, "
        f"reference copy {args.reference}, load average {os.getloadavg()}",
        file=sys.stderr,
    )
    if args.backends:
        with tempfile.TemporaryDirectory() as tmp, ray_session(args.world_size):
            for backend in args.backends.split(","):
                for size in args.sizes.split(","):
                    for seq_len in map(int, args.seq_lens.split(",")):
                        t0 = time.perf_counter()
                        rows.append(run_case(backend, size, seq_len, args, tmp))
                        print(
                            f"{backend} {size} {seq_len}: {time.perf_counter() - t0:.0f}s, "
                            f"load {os.getloadavg()[0]:.2f}: {json.dumps(rows[-1])}",
                            file=sys.stderr,
                        )
    if args.refit:
        for size in args.sizes.split(","):
            refits.append(refit_case(size, args))
            print(f"refit {size}: load {os.getloadavg()[0]:.2f}: {json.dumps(refits[-1])}", file=sys.stderr)
    print_table(rows, COLUMNS)
    if refits:
        print_table(refits, REFIT_COLUMNS)
    print(json.dumps(summary_json(rows, refits)))


if __name__ == "__main__":
    main()
