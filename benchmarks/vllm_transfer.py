"""rl-vllm's direct layerwise reload vs vLLM's own weight-transfer API (``WeightTransferEngine``), on CPU.

vLLM 0.32 ships ``vllm.distributed.weight_transfer``: a worker-side
``WeightTransferEngine`` driven through ``LLM.init_weight_transfer_engine`` ->
``start_weight_update`` -> ``update_weights`` (per chunk) -> ``finish_weight_update``.
Its dense backends (``ipc``, ``nccl``) receive checkpoint-format tensors and load
them with exactly what rl-vllm's ``InPlaceReload`` runs: ``initialize_layerwise_reload``
at start, ``model.load_weights`` per chunk, ``finalize_layerwise_reload`` at finish
(where, on CPU, each linear layer is repacked for the GEMM kernel).

**None of vLLM's backends runs on a CPU-only machine.** Checked at start, each
one's first step raises (the script prints the vLLM line it fails on):

- ``ipc``, worker side, ``ipc_engine.py:222``: ``props = torch.cuda.get_device_properties(device_index)``
  ("Torch not compiled with CUDA enabled"), before ``rebuild_cuda_tensor``; trainer side,
  ``ipc_engine.py:279``: ``self.device_index = torch.accelerator.current_device_index()``;
- ``nccl``, both sides, ``nccl_common.py:203`` / ``:255``: ``device = torch.accelerator.current_device_index()``
  ("Cannot access accelerator device when none is available"), before ``PyNcclCommunicator``;
- ``sparse_nccl`` / ``nccl_m2n`` are NCCL too, ``sharded_rdt`` uses CUDA events and
  streams, ``modelexpress`` is an external package (not installed). There is no gloo,
  shared-memory or CPU backend.

So what is measured is the transfer engine's receiving side with the transport
left out: a backend ``cpu_inmemory`` registered through vLLM's own
``WeightTransferEngineFactory.register_engine``, a subclass of ``IPCWeightTransferEngine``
(its ``start``/``finish`` unchanged) whose ``receive_weights`` takes the tensors
themselves where ``ipc`` rebuilds them from CUDA IPC handles, then runs the same
``model.load_weights`` call. It is attached to the engine the way ``Worker.load_model``
does when ``weight_transfer_config`` is set. Both sides load the same in-memory
tensors (the 134M Llama of ``refit.py``, float32) into one in-process engine
(``refit.InProcessEngine``, no Ray), in the same buckets:

- **rlcore_reload**: ``InProcessEngine.floor()``, rl-vllm's ``InPlaceReload`` (the floor of ``refit.py``);
- **transfer_engine**: the lifecycle through the public ``LLM`` methods (``collective_rpc`` to the worker);
- **transfer_engine_direct**: the same, calling the worker's methods directly (no ``collective_rpc``).

Before timing, both paths load perturbed weights and greedy generations are compared
(the transfer engine must change the outputs exactly as the reload does), then the
original weights are restored. Then the three are interleaved ``--repeats`` times
(rotating which goes first); medians, with the 1-minute load average taken before each run.

    python benchmarks/vllm_transfer.py [--repeats 7]

The last line printed is JSON: ``{"rlcore_reload_s", "transfer_engine_s", "ratio", "backend", ...}``
(ratio = transfer_engine / rlcore_reload of the medians; ratio_paired = median of each repeat's ratio).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

# The sibling benchmark's model and in-process engine.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from refit import KV_CACHE_GB, MODEL, InProcessEngine, model_params

BACKEND = "cpu_inmemory"
PROMPT = [1, 5, 9, 13, 17, 21]
SIDES = ("rlcore_reload", "transfer_engine", "transfer_engine_direct")


def failing_vllm_line(step: Callable[[], Any]) -> str | None:
    """Run ``step``; None if it works, else the exception and the innermost vLLM source line it came from."""
    try:
        step()
        return None
    except Exception as exc:  # noqa: BLE001 - the reason is the result
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if f"{os.sep}vllm{os.sep}" in f.filename]
        where = frames[-1] if frames else traceback.extract_tb(exc.__traceback__)[-1]
        path = where.filename.split(f"{os.sep}site-packages{os.sep}")[-1]
        return f"{path}:{where.lineno}: `{where.line}` -> {type(exc).__name__}: {exc}"


def probe_builtin_backends(worker: Any) -> dict[str, str | None]:
    """The first step of each side of vLLM's ``ipc`` and ``nccl`` backends, on this machine."""
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory
    from vllm.distributed.weight_transfer.ipc_engine import (
        IPCTrainerWeightTransferEngine,
    )
    from vllm.distributed.weight_transfer.nccl_common import trainer_init

    def worker_engine(backend: str) -> Any:
        return WeightTransferEngineFactory.create_engine(
            WeightTransferConfig(backend=backend), worker.vllm_config, worker.device, worker.model_runner.get_model()
        )

    def ipc_receive() -> None:  # fails before load_weights: the model is not touched
        engine = worker_engine("ipc")
        engine.receive_weights(
            engine.parse_update_info({"names": ["x"], "dtype_names": ["float32"], "shapes": [[1]], "ipc_handles": [{}]})
        )

    def nccl_join() -> None:  # fails before the rendezvous: nothing listens on the port
        engine = worker_engine("nccl")
        engine.init_transfer_engine(
            engine.parse_init_info({"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2})
        )

    return {
        "ipc trainer (trainer_init)": failing_vllm_line(
            lambda: IPCTrainerWeightTransferEngine(client=None, source=None)
        ),
        "ipc worker (receive_weights)": failing_vllm_line(ipc_receive),
        "nccl trainer (trainer_init)": failing_vllm_line(
            lambda: trainer_init({"master_address": "127.0.0.1", "master_port": 1, "world_size": 2})
        ),
        "nccl worker (init_transfer_engine)": failing_vllm_line(nccl_join),
    }


def attach_in_memory_backend(engine: InProcessEngine) -> None:
    """Register ``cpu_inmemory`` (``ipc`` with the CUDA IPC rebuild left out) and give the engine one."""
    from dataclasses import dataclass

    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory
    from vllm.distributed.weight_transfer.base import WeightTransferUpdateInfo
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine
    from vllm.model_executor.model_loader.mtp_validation import (
        disable_mtp_completeness_check,
    )

    @dataclass
    class InMemoryUpdateInfo(WeightTransferUpdateInfo):
        names: list[str]
        tensors: list[Any]

    class InMemoryWeightTransferEngine(IPCWeightTransferEngine):
        update_info_cls = InMemoryUpdateInfo

        def receive_weights(self, update_info: InMemoryUpdateInfo) -> None:
            with disable_mtp_completeness_check():  # the tail of IPCWeightTransferEngine.receive_weights
                self.model.load_weights(list(zip(update_info.names, update_info.tensors)))

    WeightTransferEngineFactory.register_engine(BACKEND, InMemoryWeightTransferEngine)
    worker = engine.vllm_worker.worker  # the Worker itself, not the executor's WorkerWrapperBase around it
    worker.vllm_config.weight_transfer_config = WeightTransferConfig(backend=BACKEND)
    # What Worker.load_model does when weight_transfer_config is set (refit.InProcessEngine starts without one).
    worker.weight_transfer_engine = WeightTransferEngineFactory.create_engine(
        worker.vllm_config.weight_transfer_config, worker.vllm_config, worker.device, worker.model_runner.get_model()
    )
    engine.engine.llm.init_weight_transfer_engine({"init_info": {"packed": False}})


def transfer(engine: InProcessEngine, direct: bool = False) -> float:
    """One weight update through the transfer engine's lifecycle, in ``refit.py``'s bucket order."""
    worker, llm = engine.vllm_worker, engine.engine.llm
    start = time.perf_counter()
    (worker if direct else llm).start_weight_update()
    for bucket in engine.plan:
        info = {"names": bucket.names, "tensors": [engine.state[name] for name in bucket.names]}
        worker.update_weights(info) if direct else llm.update_weights({"update_info": info})
    (worker if direct else llm).finish_weight_update()
    return time.perf_counter() - start


def greedy(engine: InProcessEngine) -> tuple[list[int], float]:
    from vllm import SamplingParams

    out = engine.engine.llm.generate(
        [{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0.0, max_tokens=8, logprobs=0), use_tqdm=False
    )[0].outputs[0]
    return list(out.token_ids), sum(lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids))


def same_effect(engine: InProcessEngine) -> dict[str, bool]:
    """Perturbed weights through each path: the engine's outputs must change, and identically."""
    import torch

    original, before = engine.state, greedy(engine)
    gen = torch.Generator().manual_seed(0)
    engine.state = {k: v + 0.02 * torch.randn(v.shape, generator=gen) for k, v in original.items()}
    transfer(engine)
    via_transfer = greedy(engine)
    engine.floor()
    via_reload = greedy(engine)
    engine.state = original
    engine.floor()
    restored = greedy(engine)
    return {
        "outputs_changed": via_reload[1] != before[1],
        "transfer_equals_reload": via_transfer[0] == via_reload[0] and abs(via_transfer[1] - via_reload[1]) < 1e-4,
        "restored": restored[0] == before[0] and abs(restored[1] - before[1]) < 1e-4,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)

    import torch
    import transformers

    from rlcore.refit import DEFAULT_BUCKET_BYTES
    from rlcore.testing.models import tiny_model_path

    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    model_dir = tiny_model_path(**MODEL)
    print(
        f"model: llama {MODEL}, {model_params(model_dir) / 1e6:.1f}M params float32, kv cache {KV_CACHE_GB} GB; "
        f"{args.repeats} repeats after 1 warm-up; load average {os.getloadavg()[0]:.1f}",
        file=sys.stderr,
    )

    engine = InProcessEngine(model_dir, DEFAULT_BUCKET_BYTES)
    try:
        unavailable = probe_builtin_backends(engine.vllm_worker)
        attach_in_memory_backend(engine)
        check = same_effect(engine)  # also the warm-up of both paths
        transfer(engine, direct=True)
        runs = {
            "rlcore_reload": engine.floor,
            "transfer_engine": lambda: transfer(engine),
            "transfer_engine_direct": lambda: transfer(engine, direct=True),
        }
        times: dict[str, list[float]] = {k: [] for k in SIDES}
        loads: dict[str, list[float]] = {k: [] for k in SIDES}
        for i in range(args.repeats):
            for k in SIDES[i % 3 :] + SIDES[: i % 3]:
                loads[k].append(os.getloadavg()[0])
                times[k].append(runs[k]())
    finally:
        engine.close()

    nbytes = sum(t.numel() * t.element_size() for t in engine.state.values())
    med = {k: statistics.median(v) for k, v in times.items()}
    # Each repeat's two runs are adjacent in time, so their ratio is less exposed to load that drifts between repeats.
    paired = statistics.median(t / r for t, r in zip(times["transfer_engine"], times["rlcore_reload"]))
    print("vLLM's built-in backends on this machine:")
    for step, reason in unavailable.items():
        print(f"  {step:<36}{'runs' if reason is None else 'cannot run: ' + reason}")
    print(
        f"measured instead: backend {BACKEND!r} (ipc's receive path, tensors already in memory, no transport); "
        f"{nbytes / 1e6:.1f} MB in {len(engine.plan)} buckets of <= {DEFAULT_BUCKET_BYTES >> 20} MiB; "
        f"same effect on the engine: {check}"
    )
    print(f"{'median seconds':<26}{'s':>8}{'x reload':>10}{'min s':>8}{'max s':>8}{'load':>7}")
    for k in SIDES:
        print(
            f"{k:<26}{med[k]:>8.3f}{med[k] / med['rlcore_reload']:>10.3f}{min(times[k]):>8.3f}"
            f"{max(times[k]):>8.3f}{statistics.median(loads[k]):>7.1f}"
        )
    print(
        f"transfer_engine / rlcore_reload: {med['transfer_engine'] / med['rlcore_reload']:.3f} (medians), "
        f"{paired:.3f} (median of each repeat's ratio)"
    )
    print(
        json.dumps(
            {
                "rlcore_reload_s": round(med["rlcore_reload"], 4),
                "transfer_engine_s": round(med["transfer_engine"], 4),
                "transfer_engine_direct_s": round(med["transfer_engine_direct"], 4),
                "ratio": round(med["transfer_engine"] / med["rlcore_reload"], 3),
                "ratio_direct": round(med["transfer_engine_direct"] / med["rlcore_reload"], 3),
                "ratio_paired": round(paired, 3),
                "backend": BACKEND,
                "builtin_backends_unavailable": {k: v for k, v in unavailable.items() if v is not None},
                "same_effect": check,
                "bytes": nbytes,
                "repeats": args.repeats,
                "load_average": round(statistics.median(x for v in loads.values() for x in v), 1),
            }
        )
    )


if __name__ == "__main__":
    main()
