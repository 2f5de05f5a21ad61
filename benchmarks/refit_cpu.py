"""``refit.py``'s CPU-only modes: shared-memory refits of a ~162M model without vLLM, two sender modes interleaved.

- ``--fingerprint``: verified refit's fingerprints off vs on. The sender fingerprints what it packs and
  the receiver what it received, then the core's compare runs (as with rl-vllm); besides the on/off
  difference, the fingerprints' own time is measured where it is spent, in wall and CPU seconds;
- ``--pack``: packing tensor by tensor vs one fused copy per bucket.

The receiver copies into tensors it holds (what an engine's load does, without vLLM's loader), in the
driver; the sender is a spawned process holding the weights. Wall seconds move with the machine's load;
CPU seconds (``time.process_time`` of the receiver plus the sender) much less.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

from refit_sides import MODEL


def _llama_shaped(seed: int = 0) -> dict[str, Any]:
    """The tensors of a ~162M-parameter Llama (MODEL's shapes, intermediate 3072), float32, random."""
    import torch

    g = torch.Generator().manual_seed(seed)
    h, i, v = MODEL["hidden_size"], 3072, MODEL["vocab_size"]
    shapes = {"embed_tokens.weight": (v, h), "lm_head.weight": (v, h), "norm.weight": (h,)}
    for n in range(MODEL["num_layers"]):
        for w, shape in (
            ("q_proj", (h, h)),
            ("k_proj", (h, h)),
            ("v_proj", (h, h)),
            ("o_proj", (h, h)),
            ("gate_proj", (i, h)),
            ("up_proj", (i, h)),
            ("down_proj", (h, i)),
            ("input_layernorm", (h,)),
            ("post_attention_layernorm", (h,)),
        ):
            shapes[f"layers.{n}.{w}.weight"] = shape
    return {k: torch.randn(shape, generator=g) for k, shape in shapes.items()}


class _NoFingerprints:
    """Stands in for :class:`rlcore.refit.fingerprint.Fingerprints` in a sender timed without them."""

    def add(self, named: Any) -> None:
        pass

    def result(self) -> dict:
        return {}


def _timed_fingerprints(spent: list[float]) -> type:
    """:class:`rlcore.refit.fingerprint.Fingerprints` adding its wall and CPU seconds to ``spent``."""
    from rlcore.refit.fingerprint import Fingerprints

    class TimedFingerprints(Fingerprints):
        def add(self, named: Any) -> None:
            wall, cpu = time.perf_counter(), time.process_time()
            super().add(named)
            spent[0] += time.perf_counter() - wall
            spent[1] += time.process_time() - cpu

        def result(self) -> dict[str, int]:
            wall, cpu = time.perf_counter(), time.process_time()
            out = super().result()
            spent[0] += time.perf_counter() - wall
            spent[1] += time.process_time() - cpu
            return out

    return TimedFingerprints


def _per_tensor_pack(bucket: Any, tensors: Any, buffer: Any, metadata: Any, fingerprints: Any = None) -> None:
    """The pack before issue 41: one copy per tensor (kept here to time against the fused one)."""
    import torch

    named = []
    for name, offset in zip(bucket.names, bucket.offsets):
        _, t = next(tensors)
        flat = t.detach().contiguous().reshape(-1)
        buffer[offset : offset + flat.numel() * flat.element_size()].copy_(flat.view(torch.uint8), non_blocking=True)
        named.append((name, flat))
    if fingerprints is not None:
        fingerprints.add(named)


#: What a timed sender does differently per mode (``--fingerprint``: verify on/off; ``--pack``: per-tensor/fused).
SENDER_MODES = {"off": {"fingerprints": False}, "on": {}, "per_tensor": {"pack": "per_tensor"}, "fused": {}}


def _timed_sender(address: str, authkey: bytes, commands: Any, results: Any) -> None:
    """Spawned: holds the weights; per command (a mode of SENDER_MODES), streams them once and reports the
    fingerprints it sent, its CPU seconds, and its fingerprints' own [wall, CPU] seconds."""
    import torch

    from rlcore.refit import DEFAULT_BUCKET_BYTES, metadata_of, shared_memory

    torch.set_num_threads(1)
    tensors = _llama_shaped()
    real_pack = shared_memory.pack
    results.put("ready")
    while (mode := commands.get()) is not None:
        options = SENDER_MODES[mode]
        spent = [0.0, 0.0]
        shared_memory.pack = _per_tensor_pack if options.get("pack") == "per_tensor" else real_pack
        shared_memory.Fingerprints = (
            _timed_fingerprints(spent) if options.get("fingerprints", True) else _NoFingerprints
        )
        cpu = time.process_time()
        sent = shared_memory.stream_to_receiver(
            iter(tensors.items()),
            metadata_of(tensors.items()),
            address,
            authkey,
            bucket_bytes=DEFAULT_BUCKET_BYTES,
            device=torch.device("cpu"),
        )
        results.put((sent.fingerprints, time.process_time() - cpu, spent))


def interleaved_refits(modes: tuple[str, str], repeats: int) -> dict:
    """Shared-memory refits of a ~162M model on CPU, in two sender modes interleaved (ABBA), ``repeats``
    each after a warm-up round: per mode the median wall and CPU seconds (receiver + sender), and the load
    average. With fingerprints the receiver fingerprints what it received (as the rl-vllm engine does) and
    the core's compare runs; the fingerprints' own time on each side is measured too (on a loaded machine
    an on/off difference of a few percent is below the refit's noise)."""
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
    cpus: dict[str, list[float]] = {m: [] for m in modes}
    loads: list[float] = []
    spent_by: dict[str, list[list[float]]] = {"engine": [], "sender": []}  # [wall, CPU] per refit
    try:
        results.get(timeout=600)
        for rep in range(repeats + 1):  # the first round warms up
            for mode in modes if rep % 2 == 0 else modes[::-1]:
                fingerprints = SENDER_MODES[mode].get("fingerprints", True)
                spent = [0.0, 0.0]
                received = Fingerprints()

                def load(named: list) -> None:
                    for name, t in named:
                        held[name].copy_(t)
                    if fingerprints:
                        wall_0, cpu_0 = time.perf_counter(), time.process_time()
                        received.add(named)
                        spent[0] += time.perf_counter() - wall_0
                        spent[1] += time.process_time() - cpu_0

                start, cpu = time.perf_counter(), time.process_time()
                commands.put(mode)
                receiver.receive(metadata, load, timeout_s=600)
                sent, sender_cpu, sender_spent = results.get(timeout=600)
                if fingerprints:
                    wall_0, cpu_0 = time.perf_counter(), time.process_time()
                    verify_engines(sent, [{"weight_version": rep, "fingerprints": received.result()}], version=rep)
                    spent[0] += time.perf_counter() - wall_0
                    spent[1] += time.process_time() - cpu_0
                if rep:
                    times[mode].append(time.perf_counter() - start)
                    cpus[mode].append(time.process_time() - cpu + sender_cpu)
                    loads.append(os.getloadavg()[0])
                    if fingerprints:
                        spent_by["engine"].append(spent)
                        spent_by["sender"].append(sender_spent)
        commands.put(None)
    finally:
        sender.join(timeout=60)
        receiver.close()
    med = {m: statistics.median(times[m]) for m in modes}
    out = {
        "params": sum(t.numel() for t in held.values()),
        "tensors": len(held),
        "repeats": repeats,
        **{f"{m}_s": round(med[m], 4) for m in modes},
        **{f"{m}_cpu_s": round(statistics.median(cpus[m]), 4) for m in modes},
        f"{modes[1]}_vs_{modes[0]}": round(med[modes[1]] / med[modes[0]] - 1, 4),
        "load_average_median": round(statistics.median(loads), 2),
    }
    for side, key in (("engine", "engine_fingerprint_and_compare"), ("sender", "sender_fingerprint")):
        if spent_by[side]:
            out[f"{key}_s"] = round(statistics.median(s[0] for s in spent_by[side]), 5)
            out[f"{key}_cpu_s"] = round(statistics.median(s[1] for s in spent_by[side]), 5)
    return out


def fingerprint_cost(repeats: int) -> dict:
    """``--fingerprint``'s result: :func:`interleaved_refits` off vs on, and the fingerprints' share of a refit
    without them, in wall seconds (``fingerprint_vs_refit``) and in CPU seconds (``fingerprint_vs_refit_cpu``)."""
    result = interleaved_refits(("off", "on"), repeats)
    wall = result["engine_fingerprint_and_compare_s"] + result["sender_fingerprint_s"]
    cpu = result["engine_fingerprint_and_compare_cpu_s"] + result["sender_fingerprint_cpu_s"]
    result["fingerprint_vs_refit"] = round(wall / result["off_s"], 4)
    result["fingerprint_vs_refit_cpu"] = round(cpu / result["off_cpu_s"], 4)
    return result
