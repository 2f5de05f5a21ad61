"""Helpers of the GPU-marked tests (not a test module): a refit receiver on the GPU, and measured values.

- :class:`HFReceiverWorker` / :class:`HFReceiver`: the other side of a colocated refit without vLLM.
  A Ray actor holding a Hugging Face model on the same GPU as the policy rank; it takes weights
  through rlcore's shared-memory transport (CUDA IPC on a GPU) into the model's own tensors, the
  way an engine loads in place, and computes token logprobs with the model afterwards.
- :func:`record`: a measured number (an error, a memory delta) for the summary that
  ``scripts/gpu_check/`` writes; appended as a JSON line to ``$RLCORE_GPU_RECORD`` when set,
  and printed either way (``pytest -s`` shows it).

Imported by the Ray workers as ``tests.support.support_gpu`` (the test session puts the repository root
on their ``PYTHONPATH``). torch is imported inside the functions: collecting the GPU tests on a
machine without CUDA must stay cheap.
"""

from __future__ import annotations

import json
import os
from typing import Any

#: Environment variable naming the JSON-lines file :func:`record` appends to.
RECORD_ENV = "RLCORE_GPU_RECORD"
#: Skip reasons for what a GPU machine may lack (``scripts/gpu_check/`` installs them from a wheel folder).
NO_RAY = "Ray is not installed (make gpu-check WHEELS=<folder with the ray wheel and its dependencies>)"
NO_MEGATRON = "megatron-core is not installed (make gpu-check WHEELS=<folder with a megatron_core wheel>)"


def missing(module: str) -> bool:
    """True when ``module`` cannot be found (without importing it)."""
    import importlib.util

    try:
        return importlib.util.find_spec(module) is None
    except ModuleNotFoundError:  # its parent package is missing
        return True


def record(name: str, value: Any, **extra: Any) -> None:
    """Keep a measured value: one JSON line ``{"test", "name", "value", ...}`` in ``$RLCORE_GPU_RECORD``."""
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    line = {"test": test, "name": name, "value": value, **extra}
    print(f"[gpu-record] {json.dumps(line)}")
    path = os.environ.get(RECORD_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")


def check_offload_frees_the_model(name: str, offloaded: float, plain: float, model_path: str, **extra: Any) -> None:
    """GPU bytes between steps with offload (``offloaded``) are at least the model's parameter bytes below
    the same step without (``plain``). A peer, not the model's size alone, is the reference: a CUDA process
    holds ~64 MiB whatever its model on an H100 (the size of cuBLAS's workspaces), 100x the test models."""
    from rlcore.testing.oracle import load_hf_model

    # Each parameter once: a tied embedding is one tensor under two names in a state dict.
    model_bytes = sum(p.numel() * p.element_size() for p in load_hf_model(model_path).parameters())
    record(name, offloaded, without_offload=plain, model_bytes=model_bytes, **extra)
    assert plain - offloaded >= 0.9 * model_bytes, (
        f"with offload {offloaded:.0f} B stay on the GPU, {plain:.0f} B without ({model_bytes} B of parameters)"
    )


def token_logprobs_f64(model_path: str, data: Any) -> Any:
    """The oracle of the GPU tests: a CPU Hugging Face forward in float64, aligned as design.md §2.2 says.

    Written out here rather than taken from ``rlcore.testing.oracle`` because that one rounds the
    logits to float32. (The HF RMSNorm and rotary code still compute in float32 internally: ~1e-7.)
    """
    import torch

    from rlcore.testing.oracle import load_hf_model

    model = load_hf_model(model_path).double()
    ids, lengths = data["input_ids"], data["input_lengths"]
    valid = torch.arange(ids.shape[1])[None, :] < lengths[:, None]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=valid.long(), use_cache=False).logits.double()
    next_lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    out = torch.cat([torch.zeros_like(next_lp[:, :1]), next_lp], dim=1)
    return torch.where(valid, out, torch.zeros_like(out))


def valid_error(got: Any, expected: Any, lengths: Any) -> tuple[float, float]:
    """(max, mean) absolute difference over the valid positions (1 .. length-1) of ``[B, S]`` logprobs."""
    import torch

    positions = torch.arange(got.shape[1])[None, :]
    valid = (positions >= 1) & (positions < lengths[:, None])
    diff = (got.double() - expected.double()).abs()[valid]
    return float(diff.max()), float(diff.mean())


class HFReceiverWorker:
    """Ray-hosted receiver: a Hugging Face model on this process's GPU, refitted in place."""

    def __init__(self, model_path: str, dtype: str = "float32") -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from rlcore.refit.shared_memory import ShmReceiver

        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        )
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).to(self.device)
        self.model.eval()
        # Tied weights appear under both names; the refit sends one of them, and either is the same tensor.
        self.tensors = dict(self.model.state_dict(keep_vars=True))
        self.receiver = ShmReceiver()
        self.metadata: dict | None = None

    def endpoint(self) -> tuple[str, bytes]:
        return self.receiver.address, self.receiver.authkey

    def prepare_refit_info(self, metadata: dict) -> None:
        unknown = [n for n in metadata if n not in self.tensors]
        wrong = [
            n
            for n, (shape, _) in metadata.items()
            if n in self.tensors and tuple(self.tensors[n].shape) != tuple(shape)
        ]
        if unknown or wrong:
            raise ValueError(f"refit metadata does not fit the model: unknown {unknown[:5]}, wrong shape {wrong[:5]}")
        self.metadata = metadata

    def receive(self, bucket_bytes: int) -> dict[str, Any]:
        """One colocated refit into the model's tensors; returns what arrived and on which device."""
        import torch

        seen: dict[str, str] = {}

        def load(named: list[tuple[str, Any]]) -> None:
            with torch.no_grad():
                for name, tensor in named:
                    seen[name] = tensor.device.type
                    self.tensors[name].copy_(tensor)

        stats = self.receiver.receive(self.metadata, load, timeout_s=300)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return {
            "tensors": stats.tensors,
            "bytes": stats.bytes,
            "buckets": stats.buckets,
            "devices": sorted(set(seen.values())),
            "names": sorted(seen),
        }

    def logprobs(self, data: dict) -> Any:
        """``[B, S]`` float32 token logprobs of the model as it is now (position 0 and padding 0), on CPU."""
        import torch

        ids, lengths = data["input_ids"], data["input_lengths"]
        valid = torch.arange(ids.shape[1])[None, :] < lengths[:, None]
        with torch.no_grad():
            logits = (
                self.model(input_ids=ids.to(self.device), attention_mask=valid.long().to(self.device), use_cache=False)
                .logits.float()
                .cpu()
            )
        next_lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        out = torch.cat([torch.zeros_like(next_lp[:, :1]), next_lp], dim=1)
        return torch.where(valid, out, torch.zeros_like(out))

    def memory_allocated(self) -> int:
        import torch

        return int(torch.cuda.memory_allocated(self.device)) if self.device.type == "cuda" else 0

    def shutdown(self) -> None:
        self.receiver.close()


class HFReceiver:
    """Driver-side facade over one :class:`HFReceiverWorker` on bundle 0 of ``cluster``.

    It has the generation-side surface ``WeightSynchronizer`` calls for the colocated
    transport (``prepare_refit_info``, ``refit_endpoints``, ``update_weights_via_ipc_zmq``).
    """

    def __init__(self, cluster: Any, model_path: str, dtype: str = "float32", name_prefix: str = "receiver") -> None:
        import ray

        from rlcore.distributed import NamedSharding, RayWorkerGroup

        self.worker_group = RayWorkerGroup(
            cluster,
            "tests.support.support_gpu:HFReceiverWorker",
            sharding=NamedSharding.for_world(cluster.world_size),
            name_prefix=name_prefix,
            init_args=(model_path, dtype),
        )
        self.actor = self.worker_group.workers[0]
        self._endpoint = ray.get(self.actor.call.remote("endpoint"))
        self.last: list[Any] = []

    def _call(self, method: str, *args: Any) -> Any:
        group = self.worker_group
        return group.get_results(group.run_all_workers_single_data(method, *args))[0]

    def prepare_refit_info(self, metadata: dict) -> None:
        self._call("prepare_refit_info", metadata)

    def refit_endpoints(self) -> dict[int, tuple[str, bytes]]:
        return {0: self._endpoint}  # training rank 0 shares bundle 0 with this receiver

    def update_weights_via_ipc_zmq(self, bucket_bytes: int) -> list[Any]:
        self.last = [self.actor.call.remote("receive", bucket_bytes)]
        return self.last

    def refit_world_size(self) -> int:
        return 1

    def last_receive(self) -> dict[str, Any]:
        import ray

        return ray.get(self.last[0])

    def logprobs(self, data: Any) -> Any:
        return self._call("logprobs", {k: data[k] for k in ("input_ids", "input_lengths")})

    def memory_allocated(self) -> int:
        return self._call("memory_allocated")

    def shutdown(self) -> None:
        self.worker_group.shutdown()


__all__ = [
    "HFReceiver",
    "HFReceiverWorker",
    "NO_MEGATRON",
    "NO_RAY",
    "RECORD_ENV",
    "missing",
    "record",
    "token_logprobs_f64",
    "valid_error",
]
