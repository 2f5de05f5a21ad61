"""The rlcore sides of ``benchmarks/gpu.py``: a one-GPU ``Policy`` of each backend, timed in the driver over
``Policy.train`` (Ray dispatch and result gathering count), then profiled and refitted if asked."""

from __future__ import annotations

import statistics
import time
from typing import Any

import gpu_profile
from gpu_refit_sink import SinkGroup, time_refit
from gpu_shapes import LR, make_data

#: ``dtensor-regather``: dtensor with FSDP2's own schedule, as before issue 41 (parameters re-gathered and
#: re-cast for every micro-batch's forward and backward, gradients reduce-scattered after each), beside the
#: ``dtensor`` row's defaults (gathered once a step, reduced once a step): the two rows measure the settings.
DTENSOR_SIDES = {"dtensor": {}, "dtensor-regather": {"reshard_after_forward": True, "reduce_grads": "per_micro_batch"}}


def policy_config(backend: str, path: str, seq: int, batch: int, mbs: int, dtensor_cfg: dict | None = None) -> Any:
    from rlcore.config import load_config_dict

    raw: dict[str, Any] = {
        "backend": "dtensor" if backend in DTENSOR_SIDES else backend,
        "model_name": path,
        "train_global_batch_size": batch,
        "train_micro_batch_size": mbs,
        "logprob_batch_size": mbs,
        "precision": "bfloat16",
        "max_total_sequence_length": seq,
        "learning_rate": LR,
        "max_grad_norm": 1.0,
    }
    if backend == "megatron":
        # bf16 weights and gradients, float32 main weights in the optimizer (params_dtype's default).
        raw["megatron_cfg"] = {"optimizer": {"optimizer": "adam", "bf16": True, "weight_decay": 0.01}}
    else:
        raw["optimizer"] = {"name": "torch.optim.AdamW", "kwargs": {"lr": LR}}
        raw["dtensor_cfg"] = {**DTENSOR_SIDES[backend], **(dtensor_cfg or {})}
    return load_config_dict({"cluster": {"workers_per_node": 1, "use_gpu": True}, "policy": raw}).policy


def run_policy(
    cluster: Any,
    backend: str,
    path: str,
    vocab: int,
    seq: int,
    batch: int,
    mbs: int,
    steps: int,
    warmup: int,
    sink: SinkGroup | None,
    dtensor_cfg: dict | None = None,
) -> dict:
    from rlcore.algorithms.sft.loss import NLLLoss
    from rlcore.data import BatchedDataDict
    from rlcore.policy import Policy
    from rlcore.testing.models import build_tiny_tokenizer

    policy = Policy(
        cluster,
        policy_config(backend, path, seq, batch, mbs, dtensor_cfg),
        build_tiny_tokenizer(),
        name_prefix=f"bench-{backend}",
        init_reference_model=False,
    )
    try:
        data, loss_fn = BatchedDataDict(make_data(vocab, batch, seq)), NLLLoss()
        losses = [float(policy.train(data, loss_fn)["loss"][0]) for _ in range(warmup)]
        policy._all("reset_peak_memory_stats")
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            losses.append(float(policy.train(data, loss_fn)["loss"][0]))
            times.append(time.perf_counter() - t0)
        out: dict[str, Any] = {
            "step_s": statistics.median(times),
            "times": times,
            "losses": losses,
            "peak_bytes": int(policy._all("get_gpu_info")[0].get("peak_memory_allocated_mb", 0) * 2**20),
        }
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
