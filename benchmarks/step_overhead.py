"""The one measure of training-step overhead: rlcore's backend worker vs a raw FSDP2 loop (issue 41).

Every figure rlcore publishes about step overhead comes from this script (docs/benchmarks.md).
``--world-size`` ranks (gloo, one thread each, spawned processes) each hold **both sides**, built
from the same model directory:

- **rlcore**: the backend's own worker class (``DTensorPolicyWorker``, ``FSDP1PolicyWorker``,
  ``MegatronPolicyWorker``: megatron-core on gloo, its DDP and optimizer, tp = pp = 1),
  constructed in the rank from the environment a worker group sets, and its ``train(shard,
  NLLLoss(), gbs, mbs)``: the whole optimizer step (valid counts all-reduced, micro-batches cut to
  their longest row, forward, loss, backward, grad norm and clipping, AdamW step).
- **raw**: the same model sharded by torch FSDP2 (one unit per decoder layer, then the root,
  gradients summed), and a hand-written loop over the same micro-batches of the same rows: forward,
  token NLL normalised by the step's all-reduced valid-token count, backward,
  ``clip_grad_norm_``, AdamW. ``--raw default`` (the default) is FSDP2 as a plain loop uses it
  (parameters freed after each forward, gradients reduce-scattered after every micro-batch);
  ``--raw same`` gives it rlcore's dtensor settings (``reshard_after_forward``, ``reduce_grads``),
  so the ratio is then rlcore's code alone.

Both sides: the same rows (rank r trains its contiguous share of one global batch, as rlcore's plain
sharding gives it), the same valid tokens, the same micro-batches, AdamW (lr 1e-4), max grad norm
1.0, float32. Each side is warmed up once, then ``--repeats`` rounds alternate the sides
(``interleave.py``); medians are reported.

Per step and side: **wall** seconds (rank 0, between barriers), **CPU** seconds (process CPU time,
summed over the ranks), and from one further step under ``torch.profiler`` (not timed) rank 0's
count of **collectives** (all-gathers, reduce-scatters, all-reduces, others) and of **copies**
(``aten::copy_`` calls; casts and ``.to`` copies included, as they run ``copy_``).
``--logprobs`` also times ``get_logprobs`` against a raw no-grad forward of the same rows in the
same logprob micro-batches.

    python benchmarks/step_overhead.py --quick                      # dtensor, 50m, 2 ranks
    python benchmarks/step_overhead.py --backends dtensor,fsdp1,megatron --sizes 50m,150m --repeats 5
    python benchmarks/step_overhead.py --dtensor reshard_after_forward=true --dtensor reduce_grads=per_micro_batch
    python benchmarks/step_overhead.py --versus reshard_after_forward=true --versus reduce_grads=per_micro_batch

``--versus KEY=VALUE``: a third side, interleaved with the two: a second dtensor worker with those
settings (its ratio to the same raw loop is ``*_versus_ratio``), so two settings compare under one load.

The last line printed is JSON: ``cases`` (one per backend and size: medians, ratios, counts),
``max_train_ratio`` and ``max_logprob_ratio`` (rlcore / raw wall seconds) and ``load_average``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from interleave import interleaved  # noqa: E402

_QWEN = "qwen2.5-0.5b"
_SMALL_QWEN = dict(vocab_size=32000, max_position_embeddings=4096)
#: name -> (preset, overrides). ~10M and ~50M use a 32k vocabulary (else the 151,936-row embedding
#: alone is 136M); "150m" is the 0.5B preset cut to 2 layers, "0.5b" and "1b" are the real shapes.
SIZES: dict[str, tuple[str, dict]] = {
    "tiny": (
        _QWEN,
        dict(
            hidden_size=64,
            num_layers=2,
            num_heads=2,
            num_kv_heads=1,
            head_dim=32,
            intermediate_size=128,
            vocab_size=512,
            max_position_embeddings=1024,
        ),
    ),
    "10m": (
        _QWEN,
        dict(
            hidden_size=256,
            num_layers=4,
            num_heads=4,
            num_kv_heads=2,
            head_dim=64,
            intermediate_size=1024,
            **_SMALL_QWEN,
        ),
    ),
    "50m": (
        _QWEN,
        dict(
            hidden_size=512,
            num_layers=8,
            num_heads=8,
            num_kv_heads=2,
            head_dim=64,
            intermediate_size=2048,
            **_SMALL_QWEN,
        ),
    ),
    "150m": (_QWEN, dict(num_layers=2)),
    "0.5b": (_QWEN, {}),
    "1b": ("llama-3.2-1b", {}),
}
BACKENDS = ("dtensor", "fsdp1", "megatron")
LR = 1e-4
MAX_GRAD_NORM = 1.0
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")


def model_dir_for(size: str) -> str:
    """Build (once, cached) the model of ``size``; returns its directory."""
    from rlcore.models import tiny_model_path
    from rlcore.models.presets import preset

    name, overrides = SIZES[size]
    return tiny_model_path(**preset(name, **overrides))


def make_rows(vocab_size: int, rows: int, seq_len: int) -> dict:
    """One global batch of ragged rows (lengths seq_len/2 .. seq_len), seeded: the same on every rank."""
    from rlcore.testing.models import make_batch

    return make_batch(vocab_size, rows, max(2, seq_len // 2), seq_len, seed=0)


def policy_config(
    backend: str,
    model_dir: str,
    world_size: int,
    args: argparse.Namespace,
    dtensor: list[tuple[str, Any]] | None = None,
) -> Any:
    from rlcore.config import load_config_dict

    policy = {
        "backend": backend,
        "model_name": model_dir,
        "train_global_batch_size": args.rows_per_rank * world_size,
        "train_micro_batch_size": args.micro_batch,
        "logprob_batch_size": args.logprob_batch,
        "learning_rate": LR,
        "optimizer": {"name": "torch.optim.AdamW", "kwargs": {"lr": LR}},
        "max_grad_norm": MAX_GRAD_NORM,
        "precision": "float32",
        "max_total_sequence_length": args.seq_len,
    }
    if backend == "dtensor":
        policy["dtensor_cfg"] = dict(args.dtensor if dtensor is None else dtensor)
    return load_config_dict({"cluster": {"workers_per_node": world_size}, "policy": policy}).policy


# --------------------------------------------------------------------------- counting


def classify(op_name: str) -> str | None:
    """The kind of a profiler event: a collective's kind, 'copy', or None (not counted)."""
    name = op_name.lower()
    if name == "aten::copy_":
        return "copy"
    if not name.startswith("c10d::"):
        return None
    if "reduce_scatter" in name:
        return "reduce_scatter"
    if "allgather" in name or "all_gather" in name:
        return "all_gather"
    if "allreduce" in name or "all_reduce" in name:
        return "all_reduce"
    return "other_collective"


def count_ops(fn: Any) -> dict[str, int]:
    """Run ``fn`` under the CPU profiler; how many collectives of each kind and copies it issued."""
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    counts: Counter = Counter()
    for event in prof.events():
        kind = classify(event.name)
        if kind is not None:
            counts[kind] += 1
    return {kind: counts.get(kind, 0) for kind in (*COLLECTIVES, "other_collective", "copy")}


# --------------------------------------------------------------------------- the raw side


def shard_raw(model: Any, mesh: Any, keep_gathered: bool) -> None:
    """Plain torch FSDP2: a unit per decoder layer plus the root, gradients summed over ranks;
    ``keep_gathered``: no reshard after forward (else FSDP2's default: every unit but the root)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    reshard_after_forward = False if keep_gathered else None
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


class RawLoop:
    """The hand-written step: the same micro-batches, loss normalisation, clipping and optimizer."""

    def __init__(
        self,
        model_dir: str,
        world_size: int,
        mine: dict,
        args: argparse.Namespace,
        keep_gathered: bool,
        per_step_reduction: bool,
    ) -> None:
        import torch
        from torch.distributed.device_mesh import init_device_mesh
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        shard_raw(self.model, init_device_mesh("cpu", (world_size,)), keep_gathered)
        self.keep_gathered, self.per_step_reduction = keep_gathered, per_step_reduction
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR)
        self.mine, self.mbs, self.lp_mbs = mine, args.micro_batch, args.logprob_batch

    def logprobs(self, ids: Any, lengths: Any) -> Any:
        import torch

        valid = torch.arange(ids.shape[1])[None, :] < lengths[:, None]
        logits = self.model(input_ids=ids, attention_mask=valid.long(), use_cache=False).logits[:, :-1].float()
        lp = logits.gather(-1, ids[:, 1:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
        return lp * valid[:, 1:]

    def train_step(self) -> float:
        import torch
        import torch.distributed as dist

        self.model.train()
        data = self.mine
        mask = data["token_mask"][:, 1:] * data["sample_mask"][:, None]
        counts = torch.stack([data["sample_mask"].sum(), mask.sum()]).double()
        dist.all_reduce(counts)
        starts = range(0, len(data["input_ids"]), self.mbs)
        step_loss = torch.zeros((), dtype=torch.float64)
        for i, start in enumerate(starts):
            last = i == len(starts) - 1
            if self.per_step_reduction:
                self.model.set_requires_gradient_sync(last)
            if self.keep_gathered:
                self.model.set_reshard_after_backward(last)
            mb = slice(start, start + self.mbs)
            width = int(data["input_lengths"][mb].max())
            lp = self.logprobs(data["input_ids"][mb, :width], data["input_lengths"][mb])
            loss = -(lp * mask[mb, : width - 1]).sum() / counts[1].float()
            loss.backward()
            step_loss += loss.detach().double()
        dist.all_reduce(step_loss)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), MAX_GRAD_NORM)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(step_loss)

    def logprob_pass(self) -> None:
        import torch

        self.model.eval()
        with torch.no_grad():
            for s in range(0, len(self.mine["input_ids"]), self.lp_mbs):
                ids, lengths = (
                    self.mine["input_ids"][s : s + self.lp_mbs],
                    self.mine["input_lengths"][s : s + self.lp_mbs],
                )
                self.logprobs(ids[:, : int(lengths.max())], lengths)
        if self.keep_gathered:
            for module in self.model.modules():
                if hasattr(module, "reshard"):
                    module.reshard()


# --------------------------------------------------------------------------- one rank


def raw_settings(backend: str, cfg: Any, raw: str) -> tuple[bool, bool]:
    """(keep parameters gathered through a step, reduce gradients once per step) for the raw loop."""
    if raw == "default" or backend != "dtensor":
        return False, False
    from rl_dtensor.config import dtensor_section

    section = dtensor_section(cfg)
    return (
        not getattr(section, "reshard_after_forward", True),
        getattr(section, "reduce_grads", "per_micro_batch") == "per_step",
    )


def worker_class(backend: str) -> Any:
    if backend == "dtensor":
        from rl_dtensor.worker import DTensorPolicyWorker

        return DTensorPolicyWorker
    if backend == "megatron":  # its own parallel state, built from the same environment in its constructor
        from rl_megatron.worker import MegatronPolicyWorker

        return MegatronPolicyWorker
    from rl_fsdp1.worker import FSDP1PolicyWorker

    return FSDP1PolicyWorker


def _rank(
    rank: int, world_size: int, port: int, backend: str, model_dir: str, args: argparse.Namespace, results: Any
) -> None:
    """Build both sides in this rank, time them interleaved, count one step of each; rank 0 reports."""
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig

    from rlcore.algorithms.sft.loss import NLLLoss
    from rlcore.data import BatchedDataDict

    torch.set_num_threads(1)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    cfg = policy_config(backend, model_dir, world_size, args)
    ours = worker_class(backend)(cfg, None, init_reference_model=False)
    sides = ["rlcore", "raw"]
    if args.versus and backend == "dtensor":  # a second rlcore side with other dtensor settings
        other = worker_class(backend)(
            policy_config(backend, model_dir, world_size, args, args.versus), None, init_reference_model=False
        )
        sides.append("versus")
    data = make_rows(AutoConfig.from_pretrained(model_dir).vocab_size, args.rows_per_rank * world_size, args.seq_len)
    rows = slice(rank * args.rows_per_rank, (rank + 1) * args.rows_per_rank)
    mine = {k: v[rows] for k, v in data.items()}
    keep_gathered, per_step_reduction = raw_settings(backend, cfg, args.raw)
    raw = RawLoop(model_dir, world_size, mine, args, keep_gathered, per_step_reduction)
    loss_fn, shard = NLLLoss(), BatchedDataDict(mine)
    gbs = args.rows_per_rank * world_size

    work = {
        ("rlcore", "train"): lambda: ours.train(shard, loss_fn, gbs=gbs, mbs=args.micro_batch),
        ("raw", "train"): raw.train_step,
        ("rlcore", "logprobs"): lambda: ours.get_logprobs(shard, args.logprob_batch),
        ("raw", "logprobs"): raw.logprob_pass,
    }
    if "versus" in sides:
        work.update(
            {
                ("versus", "train"): lambda: other.train(shard, loss_fn, gbs=gbs, mbs=args.micro_batch),
                ("versus", "logprobs"): lambda: other.get_logprobs(shard, args.logprob_batch),
            }
        )

    def timed(key: tuple[str, str]) -> tuple[float, float]:
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        work[key]()
        cpu = time.process_time() - c0
        dist.barrier()
        wall = time.perf_counter() - t0
        both = torch.tensor([wall, cpu], dtype=torch.float64)
        dist.all_reduce(both)  # outside the timed region: wall is rank 0's below, CPU summed
        return wall, float(both[1])

    phases = ["train"] + (["logprobs"] if args.logprobs else [])
    out: dict[str, Any] = {"tokens": int(data["token_mask"][:, 1:].sum())}
    for phase in phases:
        out[phase] = interleaved(sides, lambda side: timed((side, phase)), args.repeats)
        out[phase + "_counts"] = {side: count_ops(work[(side, phase)]) for side in sides}
    if rank == 0:
        results.put(out)
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_case(backend: str, size: str, args: argparse.Namespace) -> dict:
    """Spawn the ranks for one backend and size; the medians, ratios and counts of its steps."""
    import torch.multiprocessing as mp

    model_dir = model_dir_for(size)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank, args=(r, args.world_size, port, backend, model_dir, args, results))
        for r in range(args.world_size)
    ]
    for p in procs:
        p.start()
    out = results.get()
    for p in procs:
        p.join()
    med = statistics.median
    case: dict[str, Any] = {"backend": backend, "size": size, "tokens": out["tokens"]}
    for phase in ("train", "logprobs"):
        if phase not in out:
            continue
        for side in out[phase]:
            case[f"{phase}_{side}_s"] = med(w for w, _ in out[phase][side])
            case[f"{phase}_{side}_cpu_s"] = med(c for _, c in out[phase][side])
        case[f"{phase}_ratio"] = case[f"{phase}_rlcore_s"] / case[f"{phase}_raw_s"]
        case[f"{phase}_cpu_ratio"] = case[f"{phase}_rlcore_cpu_s"] / case[f"{phase}_raw_cpu_s"]
        if "versus" in out[phase]:
            case[f"{phase}_versus_ratio"] = case[f"{phase}_versus_s"] / case[f"{phase}_raw_s"]
            case[f"{phase}_versus_cpu_ratio"] = case[f"{phase}_versus_cpu_s"] / case[f"{phase}_raw_cpu_s"]
        case[f"{phase}_counts"] = out[phase + "_counts"]
    return case


def print_case(case: dict) -> None:
    for phase in ("train", "logprobs"):
        if f"{phase}_ratio" not in case:
            continue
        print(
            f"{case['backend']:8} {case['size']:5} {phase:8} wall rlcore {case[f'{phase}_rlcore_s']:.3f} s  "
            f"raw {case[f'{phase}_raw_s']:.3f} s  ratio {case[f'{phase}_ratio']:.3f}   cpu rlcore "
            f"{case[f'{phase}_rlcore_cpu_s']:.3f} s  raw {case[f'{phase}_raw_cpu_s']:.3f} s  ratio "
            f"{case[f'{phase}_cpu_ratio']:.3f}"
        )
        if f"{phase}_versus_ratio" in case:
            print(
                f"{'':17}{phase:8} versus {case[f'{phase}_versus_s']:.3f} s, ratio to raw "
                f"{case[f'{phase}_versus_ratio']:.3f}; cpu {case[f'{phase}_versus_cpu_s']:.3f} s, ratio "
                f"{case[f'{phase}_versus_cpu_ratio']:.3f}"
            )
        for side, counts in case[f"{phase}_counts"].items():
            print(f"{'':24}{side:7} per step (rank 0): " + ", ".join(f"{k} {v}" for k, v in counts.items()))


def parse_kv(text: str) -> tuple[str, Any]:
    """``key=value``, the value read as JSON when it is JSON (true, 3), else kept as a string."""
    key, _, value = text.partition("=")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", default="dtensor", help=f"comma-separated, of {', '.join(BACKENDS)}")
    parser.add_argument("--sizes", default="50m", help=f"comma-separated, of {', '.join(SIZES)}")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rows-per-rank", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=1, help="rows per micro-batch")
    parser.add_argument("--logprob-batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--logprobs", action="store_true", help="also time get_logprobs against a raw forward")
    parser.add_argument(
        "--raw",
        choices=("default", "same"),
        default="default",
        help="the raw loop's FSDP2 settings: FSDP2's defaults, or the same as rlcore's dtensor_cfg",
    )
    parser.add_argument(
        "--dtensor",
        action="append",
        type=parse_kv,
        default=[],
        metavar="KEY=VALUE",
        help="a policy.dtensor_cfg setting for the rlcore side (repeatable)",
    )
    parser.add_argument(
        "--versus",
        action="append",
        type=parse_kv,
        default=[],
        metavar="KEY=VALUE",
        help="a third side, interleaved: rlcore's dtensor worker with these dtensor_cfg settings "
        "(repeatable; e.g. the settings before issue 41: reshard_after_forward=true "
        "reduce_grads=per_micro_batch)",
    )
    parser.add_argument("--quick", action="store_true", help="dtensor, 50m, 3 repeats, with logprobs")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.logprobs = 3, True
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cases = []
    for backend in filter(None, args.backends.split(",")):
        for size in filter(None, args.sizes.split(",")):
            case = run_case(backend, size, args)
            print_case(case)
            cases.append(case)
    load = os.getloadavg()[0]
    print(
        f"load average (1 min) {load:.2f}; {args.world_size} ranks, {args.rows_per_rank} rows/rank, "
        f"micro-batch {args.micro_batch}, seq <= {args.seq_len}, raw FSDP2 settings: {args.raw}, "
        f"dtensor_cfg {dict(args.dtensor) or 'defaults'}",
        file=sys.stderr,
    )
    ratios = {phase: [c[f"{phase}_ratio"] for c in cases if f"{phase}_ratio" in c] for phase in ("train", "logprobs")}
    print(
        json.dumps(
            {
                "cases": cases,
                "max_train_ratio": max(ratios["train"], default=None),
                "max_logprob_ratio": max(ratios["logprobs"], default=None),
                "load_average": load,
                "raw": args.raw,
                "dtensor_cfg": dict(args.dtensor),
                "versus": dict(args.versus),
            },
            default=float,
        )
    )


if __name__ == "__main__":
    main()
