"""How long does a weight refit take, compared with just moving the same bytes?

One training ``Policy`` (``--backend``, one rank) and two vLLM engines
(``VllmGeneration``) of a >= 100M-parameter Llama built from a config
(float32):

- **colocated**: an engine sharing the training rank's bundle
  (``max_colocated_worker_groups=2``); ``WeightSynchronizer`` streams packed
  buckets through shared memory;
- **collective**: an engine on its own one-bundle cluster; the synchronizer
  broadcasts packed buckets over a gloo group (training rank 0 -> engine).

Each ``sync_weights()`` is timed in the driver, against three baselines of the
same weights measured in the same run:

- **floor**: the engine's own in-process reload of the same tensors, already in
  its memory (an in-process engine in the driver, ``InPlaceReload`` over the
  state dict in the refit's bucket order): what no transport can beat;
- **memcpy**: one ``torch`` copy of a uint8 tensor of that size into an
  already-touched tensor (driver process, one torch thread, like the ranks);
- **broadcast**: one raw gloo broadcast of a tensor of that size between two
  processes (one thread each), timed on the sender between barriers.

Everything is warmed up once, then the five measurements are interleaved
``--repeats`` times (so load from other processes hits them alike) and the
medians are reported.

``--breakdown`` then profiles, in this process, the stages a colocated refit is
made of: packing the tensors into a bucket buffer (sender), the receiver's
copies of layers split over buckets, and vLLM's layerwise ``load_weights``
(+ ``finalize``), so a missed goal can be explained.

    python benchmarks/refit.py [--backend reference] [--model-dir DIR] [--repeats 5] [--breakdown]
    python benchmarks/refit.py --fingerprint [--repeats 9]   # verified refit's cost, CPU, no vLLM
    python benchmarks/refit.py --pack [--repeats 9]          # fused vs per-tensor packing, CPU, no vLLM

The last line printed is JSON with ``colocated_vs_floor`` and ``collective_vs_floor``
(collective over max(broadcast, floor)); goals <= 1.25 each, beside the
earlier ``colocated_vs_memcpy`` / ``collective_vs_broadcast`` ratios.
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

# ~134M parameters (embeddings and an untied head of a 32k vocabulary, 12 layers), ~537 MB in float32.
MODEL = dict(hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=12, head_dim=64, intermediate_size=2048,
             vocab_size=32000, max_position_embeddings=512)
KV_CACHE_GB = 0.0625
TRANSPORTS = ("colocated", "collective")


def model_params(model_dir: str) -> int:
    import glob

    from safetensors import safe_open

    total = 0
    for path in glob.glob(os.path.join(model_dir, "*.safetensors")):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                n = 1
                for d in f.get_slice(name).get_shape():
                    n *= d
                total += n
    return total


# --------------------------------------------------------------------------- baselines


def time_memcpy(nbytes: int) -> float:
    import torch

    if not hasattr(time_memcpy, "buffers"):
        src = torch.ones(nbytes, dtype=torch.uint8)
        time_memcpy.buffers = (src, torch.zeros_like(src))  # both touched before any timing
    src, dst = time_memcpy.buffers
    t0 = time.perf_counter()
    dst.copy_(src)
    return time.perf_counter() - t0


def _broadcast_rank(rank: int, port: int, nbytes: int, commands: Any, results: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    buf = torch.full((nbytes,), rank, dtype=torch.uint8)
    results.put("ready")
    while commands[rank].get() != "stop":
        dist.barrier()
        t0 = time.perf_counter()
        dist.broadcast(buf, src=0)
        dist.barrier()
        if rank == 0:
            results.put(time.perf_counter() - t0)
    dist.destroy_process_group()


class RawBroadcast:
    """Two gloo processes kept alive between broadcasts, so they interleave with the refits."""

    def __init__(self, nbytes: int) -> None:
        import torch.multiprocessing as mp

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        self.commands = [ctx.SimpleQueue() for _ in range(2)]
        self.results = ctx.SimpleQueue()
        self.context = mp.start_processes(_broadcast_rank, args=(port, nbytes, self.commands, self.results),
                                          nprocs=2, join=False, start_method="spawn")
        for _ in range(2):
            self.results.get()

    def run(self) -> float:
        for q in self.commands:
            q.put("go")
        return self.results.get()

    def close(self) -> None:
        for q in self.commands:
            q.put("stop")
        while not self.context.join():
            pass


# --------------------------------------------------------------------------- rlcore refit


class Refits:
    """One training rank and, per transport asked for, one vLLM engine and its synchronizer:
    ``colocated`` shares the rank's bundle, ``collective`` sits on its own cluster."""

    def __init__(self, backend: str, model_dir: str, transports: tuple[str, ...] = TRANSPORTS) -> None:
        from rl_vllm.generation import VllmGeneration

        from rlcore.config import load_config_dict
        from rlcore.distributed import RayVirtualCluster
        from rlcore.policy import Policy
        from rlcore.refit import WeightSynchronizer
        from rlcore.testing.models import build_tiny_tokenizer

        tokenizer = build_tiny_tokenizer()
        cfg = load_config_dict({"cluster": {"workers_per_node": 1}, "policy": {
            "backend": backend, "model_name": model_dir, "precision": "float32",
            "train_global_batch_size": 1, "max_total_sequence_length": 128,
            **({} if backend == "megatron" else {"optimizer": {"name": "torch.optim.SGD", "kwargs": {"lr": 1e-3}}}),
            "generation": {"backend": "vllm", "max_new_tokens": 8, "pad_token_id": tokenizer.pad_token_id,
                           "vllm_cfg": {"kv_cache_space_gb": KV_CACHE_GB, "max_model_len": 128}},
        }}).policy
        self.clusters = [RayVirtualCluster([1], max_colocated_worker_groups=2, name="bench-train")]
        self.policy = Policy(self.clusters[0], cfg, tokenizer, init_reference_model=False)
        self.engines, self.sync = [], {}
        if "colocated" in transports:
            self.engines.append(VllmGeneration(self.clusters[0], cfg.generation, name_prefix="bench-coloc"))
            self.sync["colocated"] = WeightSynchronizer(self.policy, self.engines[-1], colocated=True)
            assert self.sync["colocated"].transport == "shared_memory"
        if "collective" in transports:
            self.clusters.append(RayVirtualCluster([1], name="bench-gen"))
            self.engines.append(VllmGeneration(self.clusters[-1], cfg.generation, name_prefix="bench-own"))
            self.sync["collective"] = WeightSynchronizer(self.policy, self.engines[-1], colocated=False,
                                                         cluster=self.clusters[0])
            assert self.sync["collective"].transport == "collective"

    def run(self, which: str) -> tuple[float, int]:
        t0 = time.perf_counter()
        stats = self.sync[which].sync_weights()
        return time.perf_counter() - t0, int(stats["bytes"])

    def close(self) -> None:
        for owner in (*self.engines, self.policy):
            owner.shutdown()
        for cluster in reversed(self.clusters):
            cluster.shutdown()


# --------------------------------------------------------------------------- the engine's floor, breakdown


class InProcessEngine:
    """A vLLM engine in this process (no Ray, no socket) with the model's weights already in memory.

    :meth:`floor` is the engine's own in-process reload of those tensors, in the refit's bucket
    order: the least any refit into this engine can cost. :meth:`stages` times one colocated
    refit's steps in process (pack, the receiver's copies of split layers, ``load_weights``,
    finalize), to explain a gap to the floor.
    """

    def __init__(self, model_dir: str, bucket_bytes: int) -> None:
        import torch
        from rl_vllm.config import VllmConfig
        from rl_vllm.worker import VllmGenerationWorker, _own_worker
        from transformers import AutoModelForCausalLM

        from rlcore.config.generation import GenerationConfig
        from rlcore.refit import metadata_of, plan_buckets
        from rlcore.refit.buckets import buffer_bytes

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.state = model.state_dict()
        if model.config.tie_word_embeddings:  # a refit sends the tied head once, as the embedding
            self.state.pop("lm_head.weight", None)
        self.meta = metadata_of(self.state.items())
        self.plan = plan_buckets(self.meta, bucket_bytes)
        self.buffer = torch.empty(buffer_bytes(self.plan), dtype=torch.uint8)
        self.engine = VllmGenerationWorker(GenerationConfig(model_name=model_dir, max_new_tokens=8),
                                           VllmConfig(kv_cache_space_gb=KV_CACHE_GB, max_model_len=128),
                                           engine_rank=0)
        self.vllm_worker = self.engine.llm.collective_rpc(_own_worker)[0]

    def floor(self) -> float:
        from rl_vllm.refit import InPlaceReload

        start = time.perf_counter()
        reload = InPlaceReload(self.vllm_worker)
        for bucket in self.plan:
            reload.load([(name, self.state[name]) for name in bucket.names])
        reload.finish()
        return time.perf_counter() - start

    def stages(self, profile: Any = None) -> dict[str, float]:
        from rl_vllm.refit import InPlaceReload

        from rlcore.refit.buckets import pack, split_layer_names, unpack

        split = split_layer_names(self.plan)
        stage = dict.fromkeys(("pack", "copy_split_layers", "load_weights", "finalize", "whole"), 0.0)
        start = time.perf_counter()
        reload = InPlaceReload(self.vllm_worker)  # initialize_layerwise_reload
        source = iter(self.state.items())
        for bucket in self.plan:
            t0 = time.perf_counter()
            pack(bucket, source, self.buffer, self.meta)
            t1 = time.perf_counter()
            batch = unpack(bucket, self.buffer, self.meta, copy=split)
            t2 = time.perf_counter()
            if profile is not None:
                profile.enable()
            reload.load(batch)
            if profile is not None:
                profile.disable()
            t3 = time.perf_counter()
            stage["pack"] += t1 - t0
            stage["copy_split_layers"] += t2 - t1
            stage["load_weights"] += t3 - t2
        t0 = time.perf_counter()
        reload.finish()  # finalize_layerwise_reload + the every-parameter check
        stage["finalize"] = time.perf_counter() - t0
        stage["whole"] = time.perf_counter() - start
        return stage

    def close(self) -> None:
        self.engine.shutdown()


def breakdown(engine: InProcessEngine, repeats: int) -> tuple[dict[str, float], list[tuple[str, float]]]:
    """Median seconds of each stage, and the functions ``load_weights`` spends most time in (last pass)."""
    import cProfile
    import pstats

    profile = cProfile.Profile()
    runs = [engine.stages(profile if i == repeats else None) for i in range(repeats + 1)]
    stats = pstats.Stats(profile).stats  # {(file, line, func): (cc, nc, tottime, cumtime, callers)}
    top = sorted(((func, row[2]) for (_, _, func), row in stats.items()), key=lambda x: -x[1])[:5]
    return {k: statistics.median(r[k] for r in runs[1:]) for k in runs[0]}, top  # the first is the warm-up


# --------------------------------------------------------------------------- main


KINDS = ("memcpy", "broadcast", "floor", *TRANSPORTS)


def measure(backend: str, model_dir: str, engine: InProcessEngine, repeats: int,
            transports: tuple[str, ...] = TRANSPORTS) -> tuple[dict[str, list[float]], int]:
    """One warm-up of each, then ``repeats`` interleaved rounds of the measurements (seconds)."""
    refits = Refits(backend, model_dir, transports)
    try:
        for transport in transports:
            _, nbytes = refits.run(transport)  # warm-up (metadata exchange, group set-up)
        engine.floor()
        raw = RawBroadcast(nbytes)
        try:
            raw.run()
            time_memcpy(nbytes)
            times: dict[str, list[float]] = {k: [] for k in ("memcpy", "broadcast", "floor", *transports)}
            for _ in range(repeats):
                times["memcpy"].append(time_memcpy(nbytes))
                times["broadcast"].append(raw.run())
                times["floor"].append(engine.floor())
                for transport in transports:
                    times[transport].append(refits.run(transport)[0])
        finally:
            raw.close()
    finally:
        refits.close()
    return times, nbytes


def figures(times: dict[str, list[float]], nbytes: int) -> dict:
    """Medians and the ratios of the JSON line (those of the transports measured)."""
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {"bytes": nbytes, **{f"{k}_s": round(v, 4) for k, v in med.items()}}
    if "colocated" in med:
        result["colocated_vs_floor"] = round(med["colocated"] / med["floor"], 2)
        result["colocated_vs_memcpy"] = round(med["colocated"] / med["memcpy"], 2)
    if "collective" in med:
        result["collective_vs_floor"] = round(med["collective"] / max(med["broadcast"], med["floor"]), 2)
        result["collective_vs_broadcast"] = round(med["collective"] / med["broadcast"], 2)
    return {**result, "load_average": round(os.getloadavg()[0], 1)}


def _llama_shaped(seed: int = 0) -> dict[str, Any]:
    """The tensors of a ~162M-parameter Llama (MODEL's shapes, intermediate 3072), float32, random."""
    import torch

    g = torch.Generator().manual_seed(seed)
    h, i, v = MODEL["hidden_size"], 3072, MODEL["vocab_size"]
    shapes = {"embed_tokens.weight": (v, h), "lm_head.weight": (v, h), "norm.weight": (h,)}
    for n in range(MODEL["num_layers"]):
        for w, shape in (("q_proj", (h, h)), ("k_proj", (h, h)), ("v_proj", (h, h)), ("o_proj", (h, h)),
                         ("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i)),
                         ("input_layernorm", (h,)), ("post_attention_layernorm", (h,))):
            shapes[f"layers.{n}.{w}.weight"] = shape
    return {k: torch.randn(shape, generator=g) for k, shape in shapes.items()}


class _NoFingerprints:
    """Stands in for :class:`rlcore.refit.fingerprint.Fingerprints` in a sender timed without them."""

    def add(self, named: Any) -> None:
        pass

    def result(self) -> dict:
        return {}


def _per_tensor_pack(bucket: Any, tensors: Any, buffer: Any, metadata: Any, fingerprints: Any = None) -> None:
    """The pack before issue 41: one copy per tensor (kept here to time against the fused one)."""
    import torch

    named = []
    for name, offset in zip(bucket.names, bucket.offsets):
        _, t = next(tensors)
        flat = t.detach().contiguous().reshape(-1)
        buffer[offset:offset + flat.numel() * flat.element_size()].copy_(flat.view(torch.uint8), non_blocking=True)
        named.append((name, flat))
    if fingerprints is not None:
        fingerprints.add(named)


#: What a timed sender does differently per mode (``--fingerprint``: verify on/off; ``--pack``: per-tensor/fused).
SENDER_MODES = {"off": {"fingerprints": False}, "on": {}, "per_tensor": {"pack": "per_tensor"}, "fused": {}}


def _timed_sender(address: str, authkey: bytes, commands: Any, results: Any) -> None:
    """Spawned: holds the weights; per command (a mode of SENDER_MODES), streams them once and reports the
    fingerprints it sent."""
    import torch

    from rlcore.refit import DEFAULT_BUCKET_BYTES, fingerprint, metadata_of
    from rlcore.refit import shared_memory

    torch.set_num_threads(1)
    tensors = _llama_shaped()
    real_pack = shared_memory.pack
    results.put("ready")
    while (mode := commands.get()) is not None:
        options = SENDER_MODES[mode]
        shared_memory.pack = _per_tensor_pack if options.get("pack") == "per_tensor" else real_pack
        shared_memory.Fingerprints = (fingerprint.Fingerprints if options.get("fingerprints", True)
                                      else _NoFingerprints)
        sent = shared_memory.stream_to_receiver(iter(tensors.items()), metadata_of(tensors.items()), address,
                                                authkey, bucket_bytes=DEFAULT_BUCKET_BYTES, device=torch.device("cpu"))
        results.put(sent.fingerprints)


def interleaved_refits(modes: tuple[str, str], repeats: int) -> dict:
    """Shared-memory refits of a ~162M model on CPU (no vLLM: the receiver copies into held tensors), in two
    sender modes interleaved (ABBA), ``repeats`` each after a warm-up round; per mode the median seconds, and
    the load average. With fingerprints the receiver fingerprints what it received (as the rl-vllm engine
    does) and the core's compare runs; the fingerprints' own time is also measured directly (on a loaded
    machine an on/off difference of a few percent is below the refit's noise)."""
    import multiprocessing as mp

    import torch

    from rlcore.refit import metadata_of
    from rlcore.refit.fingerprint import Fingerprints, verify_engines
    from rlcore.refit.shared_memory import ShmReceiver

    torch.set_num_threads(1)
    held = {k: torch.empty_like(t) for k, t in _llama_shaped().items()}
    metadata = metadata_of(held.items())
    ctx = mp.get_context("spawn")
    receiver, commands, results = ShmReceiver(), ctx.Queue(), ctx.Queue()
    sender = ctx.Process(target=_timed_sender, args=(receiver.address, receiver.authkey, commands, results))
    sender.start()
    times: dict[str, list[float]] = {m: [] for m in modes}
    loads: list[float] = []
    engine_s: list[float] = []  # the engine's fingerprints + the compare, timed directly
    try:
        results.get(timeout=600)
        for rep in range(repeats + 1):  # the first round warms up
            for mode in modes if rep % 2 == 0 else modes[::-1]:
                fingerprints = SENDER_MODES[mode].get("fingerprints", True)
                received = Fingerprints()
                spent = [0.0]

                def load(named: list) -> None:
                    for name, t in named:
                        held[name].copy_(t)
                    if fingerprints:
                        began = time.perf_counter()
                        received.add(named)
                        spent[0] += time.perf_counter() - began

                start = time.perf_counter()
                commands.put(mode)
                receiver.receive(metadata, load, timeout_s=600)
                sent = results.get(timeout=600)
                if fingerprints:
                    began = time.perf_counter()
                    verify_engines(sent, [{"weight_version": rep, "fingerprints": received.result()}], version=rep)
                    spent[0] += time.perf_counter() - began
                if rep:
                    times[mode].append(time.perf_counter() - start)
                    loads.append(os.getloadavg()[0])
                    if fingerprints:
                        engine_s.append(spent[0])
        commands.put(None)
    finally:
        sender.join(timeout=60)
        receiver.close()
    med = {m: statistics.median(times[m]) for m in modes}
    out = {"params": sum(t.numel() for t in held.values()), "tensors": len(held), "repeats": repeats,
           **{f"{m}_s": round(med[m], 4) for m in modes},
           f"{modes[1]}_vs_{modes[0]}": round(med[modes[1]] / med[modes[0]] - 1, 4),
           "load_average_median": round(statistics.median(loads), 2)}
    if engine_s:
        out["engine_fingerprint_and_compare_s"] = round(statistics.median(engine_s), 5)
    return out


def sender_fingerprint_cost(repeats: int) -> dict:
    """The sender's share, timed directly: fingerprinting the ~162M model's tensors as pack does (strided
    views copied at once, one read at the end), median seconds."""
    import torch

    from rlcore.refit.fingerprint import Fingerprints

    torch.set_num_threads(1)
    tensors = _llama_shaped()
    spent = []
    for _ in range(repeats + 1):
        began = time.perf_counter()
        acc = Fingerprints()
        acc.add((k, t.reshape(-1)) for k, t in tensors.items())
        acc.result()
        spent.append(time.perf_counter() - began)
    return {"sender_fingerprint_s": round(statistics.median(spent[1:]), 5)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="reference", help="training backend (reference, dtensor, ...)")
    parser.add_argument("--model-dir", help="a float32 HF model directory (default: the ~134M Llama above)")
    parser.add_argument("--transports", default=",".join(TRANSPORTS),
                        help="which refits to time (one at a time holds one engine less: the 0.5B preset on 24 GB)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--breakdown", action="store_true", help="also profile the stages of a colocated refit")
    parser.add_argument("--fingerprint", action="store_true",
                        help="only: a CPU shared-memory refit with verified-refit fingerprints on vs off (no vLLM)")
    parser.add_argument("--pack", action="store_true",
                        help="only: a CPU shared-memory refit packed tensor by tensor vs one fused copy per bucket")
    args = parser.parse_args(argv)
    if args.fingerprint:
        result = interleaved_refits(("off", "on"), args.repeats)
        result.update(sender_fingerprint_cost(args.repeats))
        result["fingerprint_vs_refit"] = round((result["engine_fingerprint_and_compare_s"]
                                                + result["sender_fingerprint_s"]) / result["off_s"], 4)
        print(json.dumps(result))
        return
    if args.pack:
        print(json.dumps(interleaved_refits(("per_tensor", "fused"), args.repeats)))
        return

    import torch
    import transformers

    from rlcore.distributed import shutdown_ray
    from rlcore.refit import DEFAULT_BUCKET_BYTES
    from rlcore.testing.models import tiny_model_path

    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    model_dir = args.model_dir or tiny_model_path(**MODEL)
    params = model_params(model_dir)
    print(f"model: {model_dir if args.model_dir else f'llama {MODEL}'}, {params / 1e6:.1f}M params float32; "
          f"backend {args.backend!r} (1 rank); {args.repeats} repeats after 1 warm-up; "
          f"load average {os.getloadavg()[0]:.1f}", file=sys.stderr)

    engine = InProcessEngine(model_dir, DEFAULT_BUCKET_BYTES)
    try:
        try:
            times, nbytes = measure(args.backend, model_dir, engine, args.repeats, tuple(args.transports.split(",")))
        finally:
            shutdown_ray()
        result = figures(times, nbytes)
        print(f"{nbytes / 1e6:.1f} MB per refit (bucket {DEFAULT_BUCKET_BYTES >> 20} MiB)")
        print(f"{'median seconds':<26}{'s':>9}{'GB/s':>8}{'min s':>9}{'max s':>9}")
        for k in times:
            med = result[f"{k}_s"]
            print(f"{k:<26}{med:>9.3f}{nbytes / med / 1e9:>8.2f}{min(times[k]):>9.3f}{max(times[k]):>9.3f}")
        print(f"colocated / floor {result.get('colocated_vs_floor')}x, collective / max(broadcast, floor) "
              f"{result.get('collective_vs_floor')}x (goals <= 1.25); colocated / memcpy "
              f"{result.get('colocated_vs_memcpy')}x, collective / broadcast {result.get('collective_vs_broadcast')}x")
        if args.breakdown:
            stages, top = breakdown(engine, max(2, args.repeats // 2))
            print("colocated refit, stage by stage (in process, no Ray; median seconds, x this run's floor):")
            for k, v in stages.items():
                print(f"  {k:<24}{v:>8.3f}{v / result['floor_s']:>8.2f}x")
            print("  inside load_weights (cProfile tottime of one pass):")
            for func, seconds in top:
                print(f"    {func:<40}{seconds:>8.3f}")
            result["breakdown"] = {k: round(v, 4) for k, v in stages.items()}
    finally:
        engine.close()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
