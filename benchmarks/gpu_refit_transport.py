"""The colocated refit transport alone on one GPU: CUDA IPC buckets from a sender process to a receiver.

``benchmarks/gpu.py`` times a whole refit from a policy (export, cast, transport, the engine's
copies). This isolates the transport (:func:`rlcore.refit.shared_memory.stream_to_receiver` and
``ShmReceiver.receive``) on bf16 tensors shaped like Qwen2.5-0.5B's (tied, 0.99 GB), at several
bucket sizes, against the floor: one device-to-device copy of the same bytes (the receiver's copy
into its own weights cannot be avoided). The sender's profile of one refit at the default bucket
size says where the time goes.

    python benchmarks/gpu_refit_transport.py [--repeats 5] [--buckets-mb 64,256,1024]

Prints a table, then JSON as the last line. Needs CUDA (prints a line and exits 0 without).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import multiprocessing as mp
import pstats
import statistics
import sys
import time
from typing import Any

#: Qwen2.5-0.5B: vocabulary, hidden, MLP width, layers, query heads, KV heads, head size.
SHAPE = dict(vocab=151936, hidden=896, mlp=4864, layers=24, heads=14, kv_heads=2, head_dim=64)


def model_shapes() -> dict[str, tuple[int, ...]]:
    s = SHAPE
    kv = s["kv_heads"] * s["head_dim"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (s["vocab"], s["hidden"])}
    for i in range(s["layers"]):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (s["hidden"], s["hidden"]),
                p + "self_attn.q_proj.bias": (s["hidden"],),
                p + "self_attn.k_proj.weight": (kv, s["hidden"]),
                p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.weight": (kv, s["hidden"]),
                p + "self_attn.v_proj.bias": (kv,),
                p + "self_attn.o_proj.weight": (s["hidden"], s["hidden"]),
                p + "mlp.gate_proj.weight": (s["mlp"], s["hidden"]),
                p + "mlp.up_proj.weight": (s["mlp"], s["hidden"]),
                p + "mlp.down_proj.weight": (s["hidden"], s["mlp"]),
                p + "input_layernorm.weight": (s["hidden"],),
                p + "post_attention_layernorm.weight": (s["hidden"],),
            }
        )
    shapes["model.norm.weight"] = (s["hidden"],)
    return shapes


def _sender(address: str, authkey: bytes, buckets: list[int], repeats: int, device_type: str, queue: Any) -> None:
    import torch

    from rlcore.refit.buckets import metadata_of
    from rlcore.refit.shared_memory import stream_to_receiver

    device = torch.device(device_type)
    tensors = {n: torch.randn(shape, device=device).to(torch.bfloat16) for n, shape in model_shapes().items()}
    metadata = metadata_of(tensors.items())
    times: dict[int, list[float]] = {}
    profile_text = ""
    for bucket in buckets:
        for r in range(repeats + 1):  # the first is a warm-up
            profiler = cProfile.Profile() if (bucket == buckets[0] and r == 1) else None
            start = time.perf_counter()
            if profiler:
                profiler.enable()
            stream_to_receiver(iter(tensors.items()), metadata, address, authkey, bucket, device)
            if profiler:
                profiler.disable()
                text = io.StringIO()
                pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(12)
                profile_text = text.getvalue()
            if r:
                times.setdefault(bucket, []).append(time.perf_counter() - start)
    queue.put({"times": times, "profile": profile_text})


def device_copy_seconds(nbytes: int, device: Any) -> float:
    """Median time of one copy of ``nbytes`` on ``device`` (CUDA events; wall clock on CPU)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(6):
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end) / 1e3)
        else:
            start = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--buckets-mb", default="64,256,1024")
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # "cpu" smoke-tests this script
    args = parser.parse_args(argv)

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"gpu_refit_transport.py: no CUDA device (torch {torch.__version__}): nothing to measure")
        print(json.dumps({"skipped": "no CUDA device"}))
        return 0
    from rlcore.refit.buckets import metadata_of
    from rlcore.refit.shared_memory import ShmReceiver

    device = torch.device(args.device)
    shapes = model_shapes()
    dest = {n: torch.empty(shape, dtype=torch.bfloat16, device=device) for n, shape in shapes.items()}
    expected = metadata_of(dest.items())
    nbytes = sum(t.numel() * t.element_size() for t in dest.values())
    buckets = [int(mb) << 20 for mb in args.buckets_mb.split(",")]

    def load(named: list) -> None:
        for name, tensor in named:
            dest[name].copy_(tensor)

    receiver, queue = ShmReceiver(), mp.get_context("spawn").Queue()
    sender = mp.get_context("spawn").Process(
        target=_sender, args=(receiver.address, receiver.authkey, buckets, args.repeats, args.device, queue)
    )
    sender.start()
    try:
        for _ in buckets:
            for _ in range(args.repeats + 1):
                receiver.receive(expected, load, timeout_s=300)
        sent = queue.get(timeout=300)
    finally:
        sender.join(timeout=60)
        receiver.close()

    copy_s = device_copy_seconds(nbytes, device)

    rows = {}
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(
        f"{name}: {len(shapes)} bf16 tensors, {nbytes / 1e9:.2f} GB; "
        f"device copy {copy_s * 1e3:.2f} ms ({nbytes / copy_s / 1e9:.0f} GB/s)"
    )
    print(f"{'bucket MB':>10} {'refit ms':>9} {'GB/s':>7} {'x copy':>7}")
    for bucket, times in sorted((int(k), v) for k, v in sent["times"].items()):
        median = statistics.median(times)
        rows[bucket >> 20] = {
            "refit_s": round(median, 5),
            "gb_s": round(nbytes / median / 1e9, 1),
            "vs_copy": round(median / copy_s, 1),
        }
        print(f"{bucket >> 20:>10} {median * 1e3:>9.1f} {nbytes / median / 1e9:>7.1f} {median / copy_s:>7.1f}")
    print(f"sender profile, one refit at {buckets[0] >> 20} MB buckets:\n{sent['profile']}", file=sys.stderr)
    print(json.dumps({"gpu": name, "bytes": nbytes, "copy_s": round(copy_s, 6), "buckets_mb": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
