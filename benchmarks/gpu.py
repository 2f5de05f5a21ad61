"""First figures on a GPU: training MFU against a raw torch step, CUDA IPC refit against a device copy,
and peak GPU memory against theory.

For each model preset (shapes of Qwen2.5-0.5B and Llama-3.2-1B, random weights built locally from a
config, bf16 safetensors cached under ``$RLCORE_CACHE/bench-models``):

- **raw**: a plain torch script in its own process does the same optimizer step on the same tokens:
  the Hugging Face model with float32 weights under ``torch.autocast(bfloat16)``, token-mean NLL over
  the same micro-batches, ``clip_grad_norm_(1.0)``, ``torch.optim.AdamW``. No rlcore code.
- **dtensor** / **megatron**: ``Policy.train`` of a one-GPU policy (bf16: FSDP2 mixed precision with
  float32 master weights / megatron-core bf16 weights with float32 main weights; AdamW; clip 1.0),
  timed in the driver, so Ray dispatch and result gathering count.

One sequence length per preset: the longest of 8192/4096/2048/1024 whose estimated peak memory
(below) stays under 70% of the GPU for every backend run (``--seq`` overrides). megatron's local
layer spec (no TransformerEngine) materialises the S x S attention scores, which is usually what
limits it. Tokens per step: ``--tokens`` (at least one sequence), micro-batch 1.

Model FLOPs per step = ``6 * N * tokens + 12 * layers * d_attn * S * tokens`` (PaLM's convention:
N counts every distinct parameter, tied embeddings once, so the LM head matmul is in; attention
counted over the full S x S, no causal discount). MFU = FLOPs / (median step time * the GPU's dense
bf16 peak: H100 SXM / H200 989.4 TFLOP/s, H100 PCIe 756; unknown GPUs get no MFU).

Memory theory: static ``16 * N`` bytes (float32 weights, gradients and two Adam moments; megatron:
bf16 weights and gradients plus float32 main weights and moments, also 16 bytes), plus activations
``34 * S * b * hidden`` bytes per layer (Korthikanti et al. 2022, bf16, flash attention), plus
``8 * heads * S^2 * b`` per layer for megatron's unfused attention, plus ``10 * b * S * vocab`` for
the logits (bf16, their float32 copy and its gradient). Measured: ``torch.cuda.max_memory_allocated``
in the training process over the timed steps.

Refit: after its steps, each policy refits its bf16 weights into a receiver in another process on
the same GPU (a Ray actor sharing the bundle) through ``WeightSynchronizer`` (colocated: CUDA IPC
buffers, default 64 MiB buckets; the receiver copies each tensor into preallocated engine-like
tensors). One warm-up, median of 3, timed in the driver. Baseline: a device-to-device copy of the
same bytes in the receiver's process (CUDA events, median of 5 after one warm-up). GB/s count the payload once.

    python benchmarks/gpu.py [--presets 0.5b,1b] [--backends dtensor,dtensor-regather,megatron] [--seq S]
                             [--tokens 16384] [--steps 5] [--warmup 2] [--budget-s 1800] [--profile DIR]
                             [--dtensor-cfg '{"reshard_after_forward": true}']

``dtensor-regather`` is the dtensor backend with FSDP2's per-micro-batch schedule (``reshard_after_forward:
true``, ``reduce_grads: per_micro_batch``), beside ``dtensor`` with its defaults (issue 41).

``--profile DIR``: one more step of each side under the torch profiler, summed by kernel
(:mod:`gpu_profile`), printed after the tables and kept in the JSON.

Without CUDA it prints one line and exits 0. The last line printed is JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import gpu_profile

HERE = Path(__file__).resolve().parent
#: Ray workers import the receiver below as ``gpu:RefitSink`` (this directory goes on their PYTHONPATH).
SINK_CLASS = f"{Path(__file__).stem}:RefitSink"

#: Hugging Face config arguments of each preset (random weights; only the shapes are the real models').
PRESETS: dict[str, dict[str, Any]] = {
    "0.5b": {"arch": "qwen2", "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
             "num_key_value_heads": 2, "intermediate_size": 4864, "vocab_size": 151936,
             "tie_word_embeddings": True, "max_position_embeddings": 32768},
    "1b": {"arch": "llama", "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
           "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 8192, "vocab_size": 128256,
           "tie_word_embeddings": True, "max_position_embeddings": 131072},
}
#: Dense bf16 tensor-core peak, TFLOP/s, by a substring of the device name (first match wins).
PEAK_BF16_TFLOPS = (("H200", 989.4), ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.4),
                    ("H800", 989.4), ("A100", 312.0), ("L40S", 362.1))
SEQ_CANDIDATES = (8192, 4096, 2048, 1024)
MEMORY_FRACTION = 0.70
LR = 1e-5
#: Rough seconds each unit of work needs, to skip what the time budget cannot hold.
COST_S = {"prepare": 30, "raw": 35, "dtensor": 60, "dtensor-regather": 60, "megatron": 80}
#: ``dtensor-regather``: dtensor with FSDP2's own schedule, as before issue 41 (parameters re-gathered and
#: re-cast for every micro-batch's forward and backward, gradients reduce-scattered after each), beside the
#: ``dtensor`` row's defaults (gathered once a step, reduced once a step): the two rows measure the settings.
DTENSOR_SIDES = {"dtensor": {},
                 "dtensor-regather": {"reshard_after_forward": True, "reduce_grads": "per_micro_batch"}}


# --------------------------------------------------------------------------- shapes and theory


def shape_of(preset: str) -> dict[str, int]:
    p = PRESETS[preset]
    heads = p["num_attention_heads"]
    head_dim = p.get("head_dim") or p["hidden_size"] // heads
    return {"layers": p["num_hidden_layers"], "hidden": p["hidden_size"], "heads": heads,
            "d_attn": heads * head_dim, "vocab": p["vocab_size"]}


def model_flops(n_params: int, shape: dict[str, int], seq: int, tokens: int) -> float:
    return 6.0 * n_params * tokens + 12.0 * shape["layers"] * shape["d_attn"] * seq * tokens


def memory_theory(backend: str, n_params: int, shape: dict[str, int], seq: int, mbs: int) -> dict[str, float]:
    static = 16.0 * n_params
    activations = 34.0 * seq * mbs * shape["hidden"] * shape["layers"]
    if backend == "megatron":
        activations += 8.0 * shape["heads"] * seq * seq * mbs * shape["layers"]
    logits = 10.0 * mbs * seq * shape["vocab"]
    return {"static": static, "activations": activations, "logits": logits, "total": static + activations + logits}


def pick_seq(backends: list[str], n_params: int, shape: dict[str, int], gpu_bytes: float) -> int:
    for seq in SEQ_CANDIDATES:
        if all(memory_theory(b, n_params, shape, seq, 1)["total"] <= MEMORY_FRACTION * gpu_bytes
               for b in backends + ["raw"]):
            return seq
    return SEQ_CANDIDATES[-1]


def peak_tflops(device_name: str) -> float | None:
    return next((tflops for key, tflops in PEAK_BF16_TFLOPS if key in device_name), None)


def make_data(vocab: int, batch: int, seq: int) -> dict:
    """Full-length rows of random token ids (no padding): every step sees ``batch * seq`` tokens."""
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (batch, seq), generator=g)
    mask = torch.ones(batch, seq)
    mask[:, 0] = 0
    return {"input_ids": ids, "input_lengths": torch.full((batch,), seq), "token_mask": mask,
            "sample_mask": torch.ones(batch)}


# --------------------------------------------------------------------------- subprocess modes


def cache_root() -> Path:
    base = os.environ.get("RLCORE_CACHE")
    return (Path(base) if base else Path.home() / ".cache" / "rlcore") / "bench-models"


def prepare(preset: str) -> dict:
    """Build the preset's model (random weights, bf16 safetensors) once, on the GPU; report the GPU."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from rlcore.testing.models import build_tiny_tokenizer

    kwargs = dict(PRESETS[preset])
    arch = kwargs.pop("arch")
    digest = hashlib.sha256(json.dumps([preset, kwargs, transformers.__version__], sort_keys=True).encode())
    path = cache_root() / f"{preset}-{digest.hexdigest()[:12]}"
    built = 0.0
    if not (path / "config.json").exists():
        t0 = time.perf_counter()
        tokenizer = build_tiny_tokenizer()
        config_cls = {"qwen2": transformers.Qwen2Config, "llama": transformers.LlamaConfig}[arch]
        config = config_cls(**kwargs, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                            pad_token_id=tokenizer.pad_token_id)
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
        transformers.utils.logging.disable_progress_bar()
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))  # preflight wants a complete model directory
        try:
            os.rename(tmp, path)
        except OSError:  # another process built it first
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
        built = time.perf_counter() - t0
        n_params = sum(p.numel() for p in model.parameters())
        del model
    else:
        config = transformers.AutoConfig.from_pretrained(str(path))
        with torch.device("meta"):
            n_params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    props = torch.cuda.get_device_properties(0)
    return {"path": str(path), "params": int(n_params), "build_s": round(built, 1),
            "gpu": {"name": props.name, "total_bytes": int(props.total_memory),
                    "capability": f"{props.major}.{props.minor}", "count": torch.cuda.device_count()},
            "torch": torch.__version__, "transformers": transformers.__version__}


def raw_step(path: str, seq: int, batch: int, mbs: int, steps: int, warmup: int, device: str = "cuda") -> dict:
    """The raw torch side: the same optimizer step without rlcore (see the module docstring).

    ``device`` is "cuda" for the measurement ("cpu" only smoke-tests this code path).
    """
    import torch
    from transformers import AutoModelForCausalLM

    device = torch.device(device)
    cuda = device.type == "cuda"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR)
    data = make_data(model.config.vocab_size, batch, seq)
    ids, mask = data["input_ids"].to(device), data["token_mask"].to(device)
    attention = torch.ones_like(ids)
    tokens = mask[:, 1:].sum()

    def step() -> float:
        total = torch.zeros((), device=device)
        for s in range(0, batch, mbs):
            rows = slice(s, s + mbs)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                logits = model(input_ids=ids[rows], attention_mask=attention[rows], use_cache=False).logits
            logits = logits[:, :-1].float()
            lp = logits.gather(-1, ids[rows, 1:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
            loss = -(lp * mask[rows, 1:]).sum() / tokens
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(total)

    losses = [step() for _ in range(warmup)]
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        losses.append(step())  # float() waits for the step
        times.append(time.perf_counter() - t0)
    out = {"step_s": statistics.median(times), "times": times, "losses": losses,
           "peak_bytes": int(torch.cuda.max_memory_allocated()) if cuda else 0}
    if (folder := gpu_profile.profile_dir()) is not None:
        with torch.profiler.profile() as profiler:
            step()
        profiler.export_chrome_trace(str(folder / "trace_raw.json"))
        out["profile"] = gpu_profile.summarize_trace(folder / "trace_raw.json")
    return out


def run_subprocess(args: list[str], timeout_s: float) -> dict:
    """Run this script in a fresh process in one of its modes; its last stdout line is JSON."""
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), *args], capture_output=True, text=True,
                          timeout=max(10.0, timeout_s))
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-6:]
        raise RuntimeError(f"{args[0]} failed (exit {proc.returncode}): " + " | ".join(tail))
    return json.loads(lines[-1])


# --------------------------------------------------------------------------- the receiver (a Ray actor)


class RefitSink:
    """An engine-like refit target on this process's GPU: one preallocated tensor per weight."""

    def __init__(self) -> None:
        import torch

        from rlcore.refit.shared_memory import ShmReceiver

        self.device = torch.device("cuda", torch.cuda.current_device())
        self.receiver = ShmReceiver()
        self.dest: dict[str, Any] = {}
        self.metadata: dict | None = None

    def endpoint(self) -> tuple[str, bytes]:
        return self.receiver.address, self.receiver.authkey

    def prepare_refit_info(self, metadata: dict) -> None:
        import torch

        from rlcore.refit.buckets import to_dtype

        self.dest = {}
        torch.cuda.empty_cache()
        self.dest = {name: torch.empty(tuple(shape), dtype=to_dtype(dtype), device=self.device)
                     for name, (shape, dtype) in metadata.items()}
        self.metadata = metadata

    def receive(self, bucket_bytes: int) -> int:
        import torch

        def load(named: list) -> None:
            for name, tensor in named:
                self.dest[name].copy_(tensor)

        stats = self.receiver.receive(self.metadata, load, timeout_s=600)
        torch.cuda.synchronize(self.device)
        return stats.tensors

    def payload_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.dest.values())

    def time_copy(self, nbytes: int) -> float:
        """Median seconds of one device-to-device copy of ``nbytes`` (CUDA events)."""
        import torch
        from gpu_refit_transport import device_copy_seconds

        seconds = device_copy_seconds(nbytes, self.device)
        torch.cuda.empty_cache()
        return seconds

    def shutdown(self) -> None:
        self.receiver.close()


class SinkGroup:
    """Driver-side facade with the surface ``WeightSynchronizer`` uses for a colocated engine."""

    def __init__(self, cluster: Any) -> None:
        import ray

        from rlcore.distributed import NamedSharding, RayWorkerGroup

        self.worker_group = RayWorkerGroup(cluster, SINK_CLASS, sharding=NamedSharding.for_world(1),
                                           name_prefix="bench-refit-sink")
        self.actor = self.worker_group.workers[0]
        self._endpoint = ray.get(self.actor.call.remote("endpoint"))

    def call(self, method: str, *args: Any) -> Any:
        import ray

        return ray.get(self.actor.call.remote(method, *args))

    def prepare_refit_info(self, metadata: dict) -> None:
        self.call("prepare_refit_info", metadata)

    def refit_endpoints(self) -> dict:
        return {0: self._endpoint}

    def update_weights_via_ipc_zmq(self, bucket_bytes: int) -> list:
        return [self.actor.call.remote("receive", bucket_bytes)]

    def refit_world_size(self) -> int:
        return 1

    def shutdown(self) -> None:
        self.worker_group.shutdown()


# --------------------------------------------------------------------------- the policies


def policy_config(backend: str, path: str, seq: int, batch: int, mbs: int, dtensor_cfg: dict | None = None) -> Any:
    from rlcore.config import load_config_dict

    raw: dict[str, Any] = {"backend": "dtensor" if backend in DTENSOR_SIDES else backend, "model_name": path,
                           "train_global_batch_size": batch,
                           "train_micro_batch_size": mbs, "logprob_batch_size": mbs, "precision": "bfloat16",
                           "max_total_sequence_length": seq, "learning_rate": LR, "max_grad_norm": 1.0}
    if backend == "megatron":
        # bf16 weights and gradients, float32 main weights in the optimizer (params_dtype's default).
        raw["megatron_cfg"] = {"optimizer": {"optimizer": "adam", "bf16": True, "weight_decay": 0.01}}
    else:
        raw["optimizer"] = {"name": "torch.optim.AdamW", "kwargs": {"lr": LR}}
        raw["dtensor_cfg"] = {**DTENSOR_SIDES[backend], **(dtensor_cfg or {})}
    return load_config_dict({"cluster": {"workers_per_node": 1, "use_gpu": True}, "policy": raw}).policy


def run_policy(cluster: Any, backend: str, path: str, vocab: int, seq: int, batch: int, mbs: int, steps: int,
               warmup: int, sink: SinkGroup | None, dtensor_cfg: dict | None = None) -> dict:
    from rlcore.algorithms.loss_functions import NLLLoss
    from rlcore.data import BatchedDataDict
    from rlcore.policy import Policy
    from rlcore.testing.models import build_tiny_tokenizer

    policy = Policy(cluster, policy_config(backend, path, seq, batch, mbs, dtensor_cfg), build_tiny_tokenizer(),
                    name_prefix=f"bench-{backend}", init_reference_model=False)
    try:
        data, loss_fn = BatchedDataDict(make_data(vocab, batch, seq)), NLLLoss()
        losses = [float(policy.train(data, loss_fn)["loss"][0]) for _ in range(warmup)]
        policy._all("reset_peak_memory_stats")
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            losses.append(float(policy.train(data, loss_fn)["loss"][0]))
            times.append(time.perf_counter() - t0)
        out: dict[str, Any] = {"step_s": statistics.median(times), "times": times, "losses": losses,
                               "peak_bytes": int(policy._all("get_gpu_info")[0].get("peak_memory_allocated_mb", 0) * 2**20)}
        if (folder := gpu_profile.profile_dir()) is not None:
            try:
                policy.start_gpu_profiling()
                policy.train(data, loss_fn)
                policy.stop_gpu_profiling()  # the worker writes trace_rank0.json there
                out["profile"] = gpu_profile.summarize_trace(folder / "trace_rank0.json")
            except Exception as exc:  # noqa: BLE001 - the timings above still count
                out["profile"] = {"error": str(exc)[:300]}
        if sink is not None:
            try:
                out["refit"] = time_refit(policy, sink)
            except Exception as exc:  # noqa: BLE001 - the timings above still count
                out["refit_error"] = str(exc)[:300]
        return out
    finally:
        policy.shutdown()


def time_refit(policy: Any, sink: SinkGroup) -> dict:
    from rlcore.refit import WeightSynchronizer

    sync = WeightSynchronizer(policy, sink, colocated=True)
    sync.sync_weights()  # warm-up: sender buffers, IPC handles
    refit_s = statistics.median([sync.sync_weights()["seconds"] for _ in range(3)])
    nbytes = sink.call("payload_bytes")
    copy_s = sink.call("time_copy", nbytes)
    return {"bytes": nbytes, "refit_s": refit_s, "refit_gb_s": nbytes / refit_s / 1e9,
            "d2d_copy_s": copy_s, "d2d_gb_s": nbytes / copy_s / 1e9, "ratio": refit_s / copy_s}


# --------------------------------------------------------------------------- main


def _round(x: Any, n: int = 4) -> Any:
    return round(x, n) if isinstance(x, float) else x


def summarize(side: dict, flops: float, peak: float | None, raw_s: float | None, theory: dict | None) -> dict:
    if "step_s" not in side:
        return side
    out = {"step_s": _round(side["step_s"]), "tflops": _round(flops / side["step_s"] / 1e12, 1),
           "mfu": _round(flops / side["step_s"] / (peak * 1e12), 3) if peak else None,
           "peak_gb": _round(side["peak_bytes"] / 1e9, 2), "loss": _round(side["losses"][-1])}
    if raw_s:
        out["vs_raw"] = _round(side["step_s"] / raw_s, 3)
    if theory:
        out["theory_gb"] = _round(theory["total"] / 1e9, 2)
        out["theory_static_gb"] = _round(theory["static"] / 1e9, 2)
        out["peak_vs_theory"] = _round(side["peak_bytes"] / theory["total"], 2)
    for key in ("profile", "refit_error"):
        if key in side:
            out[key] = side[key]
    if "refit" in side:
        r = side["refit"]
        out["refit"] = {"bytes": r["bytes"], "refit_s": _round(r["refit_s"]), "refit_gb_s": _round(r["refit_gb_s"], 1),
                        "d2d_gb_s": _round(r["d2d_gb_s"], 1), "refit_vs_d2d": _round(r["ratio"], 1)}
    return out


def _importable(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # the parent package is missing
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default="0.5b,1b")
    parser.add_argument("--backends", default="dtensor,dtensor-regather,megatron",
                        help="of dtensor, dtensor-regather (FSDP2's per-micro-batch schedule), megatron")
    parser.add_argument("--dtensor-cfg", type=json.loads, default={}, metavar="JSON",
                        help="policy.dtensor_cfg settings for the dtensor rows, over each row's own")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default: the longest that fits)")
    parser.add_argument("--tokens", type=int, default=16384, help="tokens per optimizer step")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--budget-s", type=float, default=1800.0, help="skip what would not finish in this time")
    parser.add_argument("--no-refit", action="store_true")
    parser.add_argument("--profile", metavar="DIR", help="profile one more step of each side; traces go to DIR")
    # Internal modes (the script runs itself in fresh processes).
    parser.add_argument("--prepare", metavar="PRESET", help=argparse.SUPPRESS)
    parser.add_argument("--raw", nargs=6, metavar="X", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.prepare:
        print(json.dumps(prepare(args.prepare)))
        return 0
    if args.raw:
        path, *numbers = args.raw
        print(json.dumps(raw_step(path, *map(int, numbers))))
        return 0

    deadline = time.monotonic() + args.budget_s
    if args.profile:  # before Ray starts: its workers inherit the variable
        Path(args.profile).mkdir(parents=True, exist_ok=True)
        os.environ["RLCORE_PROFILE_DIR"] = str(Path(args.profile).resolve())
    import torch

    if not torch.cuda.is_available():
        print(f"benchmarks/gpu.py: no CUDA device (torch {torch.__version__}): nothing to measure")
        print(json.dumps({"skipped": "no CUDA device"}))
        return 0
    presets = [p for p in args.presets.split(",") if p]
    backends = [b for b in args.backends.split(",") if b]
    unknown = [p for p in presets if p not in PRESETS] + [b for b in backends if b not in COST_S or b == "raw"]
    if unknown:
        parser.error(f"unknown presets/backends {unknown}; presets: {sorted(PRESETS)}, backends: {sorted(set(COST_S) - {'prepare', 'raw'})}")
    missing: dict[str, str] = {}
    if not _importable("ray"):
        missing.update({b: "Ray is not installed" for b in backends})
    if "megatron" in backends and not _importable("megatron.core"):
        missing.setdefault("megatron", "megatron-core is not installed")
    for backend, why in missing.items():
        print(f"{why}: the {backend} rows are skipped", file=sys.stderr)
    backends = [b for b in backends if b not in missing]

    def left() -> float:
        return deadline - time.monotonic()

    results: dict[str, Any] = {"presets": {}, "gpu": None, "peak_bf16_tflops": None}
    os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])])
    cluster = None
    try:
        for preset in presets:
            entry: dict[str, Any] = results["presets"].setdefault(preset, {})
            entry.update({backend: {"skipped": why} for backend, why in missing.items()})
            if left() < COST_S["prepare"] + COST_S["raw"]:
                entry["skipped"] = "time budget"
                continue
            try:
                prep = run_subprocess(["--prepare", preset], left())
            except Exception as exc:  # noqa: BLE001 - the next preset may still run
                entry["error"] = str(exc)[:300]
                continue
            gpu = prep["gpu"]
            results.update(gpu=gpu["name"], peak_bf16_tflops=peak_tflops(gpu["name"]), torch=prep["torch"])
            shape, n_params = shape_of(preset), prep["params"]
            seq = args.seq or pick_seq(backends, n_params, shape, gpu["total_bytes"])
            batch = max(1, args.tokens // seq)
            tokens = batch * (seq - 1)  # trained tokens: every position but the first of each row
            flops = model_flops(n_params, shape, seq, batch * seq)
            entry.update(params=n_params, seq=seq, batch=batch, micro_batch=1, tokens_per_step=batch * seq,
                         trained_tokens_per_step=tokens, model_tflop_per_step=_round(flops / 1e12, 2))
            print(f"[{preset}] {n_params / 1e9:.3f}B params, S={seq}, {batch} x {seq} tokens/step, "
                  f"{flops / 1e12:.1f} TFLOP/step", file=sys.stderr, flush=True)
            peak = results["peak_bf16_tflops"]
            raw_s = None
            try:
                raw = run_subprocess(["--raw", prep["path"], str(seq), str(batch), "1", str(args.steps),
                                      str(args.warmup)], left())
                raw_s = raw["step_s"]
                entry["raw"] = summarize(raw, flops, peak, None, memory_theory("raw", n_params, shape, seq, 1))
            except Exception as exc:  # noqa: BLE001 - reported in the table, the other rows still run
                entry["raw"] = {"error": str(exc)[:300]}
            print(f"[{preset}] raw: {entry['raw']}", file=sys.stderr, flush=True)
            print(json.dumps(results), file=sys.stderr, flush=True)
            if cluster is None:
                from rlcore.distributed import RayVirtualCluster

                cluster = RayVirtualCluster([1], use_gpus=True, max_colocated_worker_groups=2, name="bench-gpu")
            sink = None
            try:
                for backend in backends:
                    if left() < COST_S[backend]:
                        entry[backend] = {"skipped": "time budget"}
                        continue
                    if sink is None and not args.no_refit:
                        sink = SinkGroup(cluster)
                    try:
                        side = run_policy(cluster, backend, prep["path"], shape["vocab"], seq, batch, 1, args.steps,
                                          args.warmup, sink, args.dtensor_cfg)
                        entry[backend] = summarize(side, flops, peak, raw_s,
                                                   memory_theory(backend, n_params, shape, seq, 1))
                    except Exception as exc:  # noqa: BLE001
                        entry[backend] = {"error": str(exc)[:300]}
                    print(f"[{preset}] {backend}: {entry[backend]}", file=sys.stderr, flush=True)
                    print(json.dumps(results), file=sys.stderr, flush=True)  # the result so far, if stopped
            finally:
                if sink is not None:
                    sink.shutdown()
    finally:
        if cluster is not None:
            cluster.shutdown()

    print_tables(results)
    profiles = {f"{preset} {side}": row["profile"] for preset, entry in results["presets"].items()
                for side, row in entry.items() if isinstance(row, dict) and "profile" in row}
    gpu_profile.print_profiles(profiles, sys.stdout)
    print(json.dumps(results))
    return 0


def print_tables(results: dict) -> None:
    print(f"GPU: {results.get('gpu')}, dense bf16 peak {results.get('peak_bf16_tflops')} TFLOP/s, "
          f"torch {results.get('torch')}")
    header = f"{'preset':<7}{'S':>6}{'tok/step':>9} {'side':<17}{'step s':>8}{'TFLOP/s':>9}{'MFU':>7}{'vs raw':>8}" \
             f"{'peak GB':>9}{'theory GB':>10}"
    print(header)
    for preset, entry in results["presets"].items():
        for side in ("raw", *DTENSOR_SIDES, "megatron"):
            row = entry.get(side)
            if row is None:
                continue
            if "step_s" not in row:
                print(f"{preset:<7}{entry.get('seq', ''):>6}{entry.get('tokens_per_step', ''):>9} {side:<17}"
                      f"{row.get('error') or row.get('skipped')}")
                continue
            mfu = f"{row['mfu']:.3f}" if row.get("mfu") is not None else "-"
            print(f"{preset:<7}{entry['seq']:>6}{entry['tokens_per_step']:>9} {side:<17}{row['step_s']:>8.3f}"
                  f"{row['tflops']:>9.1f}{mfu:>7}{row.get('vs_raw', 1.0):>8.3f}{row['peak_gb']:>9.2f}"
                  f"{row.get('theory_gb', math.nan):>10.2f}")
    print(f"{'preset':<7} {'refit from':<17}{'GB':>7}{'refit s':>9}{'GB/s':>8}{'d2d GB/s':>10}{'x d2d':>7}")
    for preset, entry in results["presets"].items():
        for side in (*DTENSOR_SIDES, "megatron"):
            r = (entry.get(side) or {}).get("refit")
            if r:
                print(f"{preset:<7} {side:<17}{r['bytes'] / 1e9:>7.2f}{r['refit_s']:>9.4f}{r['refit_gb_s']:>8.1f}"
                      f"{r['d2d_gb_s']:>10.1f}{r['refit_vs_d2d']:>7.1f}")


if __name__ == "__main__":
    sys.exit(main())
