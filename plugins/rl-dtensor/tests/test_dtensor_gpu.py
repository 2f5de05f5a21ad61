"""dtensor's CUDA-only paths (skipped without CUDA); the cross-backend checks are tests/backends/test_backends_gpu.py.

- FSDP2 CPU offload on a GPU (``CPUOffloadPolicy(pin_memory=True)``, which CPU machines cannot
  run) with activation checkpointing: logprobs equal float64 HF, one step equals the
  single-process step, the weights really live in host memory (the GPU holds at least a model's
  bytes less than without offload), and the gathered weights (refit
  and checkpoint path) come out right.
- Two GPUs (skipped with fewer): tensor + sequence parallel over NCCL against the same references,
  and context parallel refused with a clear error.

Never what CI depends on: run on a GPU machine with ``make gpu-check``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from dtensor_testlib import batch as make_data
from dtensor_testlib import full_weights, max_abs_diff, model_dir, oracle_step, policy_config

from rlcore.algorithms.loss_functions import NLLLoss
from tests.support.support_gpu import NO_RAY, check_offload_frees_the_model, missing

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(missing("ray"), reason=NO_RAY),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

#: float32 on the GPU vs float64 HF on CPU; a step vs the single-process CPU step.
ATOL = 1e-5
STEP_ATOL = 1e-4


def _gpu_cluster(world: int) -> Any:
    from rlcore.distributed import RayVirtualCluster

    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    return RayVirtualCluster([world], use_gpus=True)


def _f64_error(model: str, data: Any, got: torch.Tensor) -> float:
    from tests.support.support_gpu import token_logprobs_f64, valid_error

    return valid_error(got, token_logprobs_f64(model, data), data["input_lengths"])[0]


def _call(policy: Any, method: str, *args: Any) -> list[Any]:
    wg = policy.worker_group
    return wg.get_results(wg.run_all_workers_single_data(method, *args))


def test_cpu_offload_with_activation_checkpointing_on_one_gpu(
    ray_session: None, tiny_tokenizer: Any, tmp_path: Any
) -> None:
    from rlcore.policy import Policy
    from rlcore.testing.oracle import load_hf_model, state_copy
    from tests.support.support_gpu import record

    model = model_dir("qwen2", tie_word_embeddings=True)
    data = make_data(tiny_tokenizer)
    cluster = _gpu_cluster(1)
    try:
        cfg = policy_config(
            model, world=1, use_gpu=True, dtensor_cfg={"cpu_offload": True, "activation_checkpointing": True}
        )
        policy = Policy(cluster, cfg, tiny_tokenizer, name_prefix="dt-gpu-offload", init_reference_model=False)
        try:
            assert _call(policy, "report_device_id")[0].startswith("cuda")
            err = _f64_error(model, data, policy.get_logprobs(data)["logprobs"])
            record("cpu_offload_logprobs_vs_hf_f64_max_abs", err, tolerance=ATOL)
            assert err <= ATOL

            _, expected = oracle_step(model, data, NLLLoss())
            out = policy.train(data, NLLLoss())
            on_gpu = _gpu_bytes(policy)
            assert abs(float(out["loss"][0]) - expected.loss) <= 1e-5 * abs(expected.loss)
            gathered = full_weights(policy)  # gathered from the shards: the refit path
            assert set(gathered) <= set(expected.weights), sorted(set(gathered) - set(expected.weights))
            worst, name = max_abs_diff(gathered, {k: expected.weights[k] for k in gathered})
            record("cpu_offload_step_weights_max_abs", worst, tolerance=STEP_ATOL)
            assert worst <= STEP_ATOL, name
            after_gather = _gpu_bytes(policy)  # what the refit path leaves on the GPU (recorded, not judged)

            policy.save_checkpoint(str(tmp_path / "weights"))
            saved = state_copy(load_hf_model(str(tmp_path / "weights")))
            worst, name = max_abs_diff({k: v for k, v in saved.items() if k in expected.weights}, expected.weights)
            assert worst <= STEP_ATOL, name
            assert {dtype for _, dtype in policy.prepare_refit_info().values()} == {"float32"}
        finally:
            policy.shutdown()

        plain = Policy(
            cluster,
            policy_config(model, world=1, use_gpu=True, dtensor_cfg={"activation_checkpointing": True}),
            tiny_tokenizer,
            name_prefix="dt-gpu-no-offload",
            init_reference_model=False,
        )
        try:
            plain.train(data, NLLLoss())
            plain_on_gpu = _gpu_bytes(plain)
        finally:
            plain.shutdown()
        check_offload_frees_the_model(
            "cpu_offload_gpu_bytes_between_steps", on_gpu, plain_on_gpu, model, after_refit_gather=after_gather
        )
    finally:
        cluster.shutdown()


def _gpu_bytes(policy: Any) -> float:
    return _call(policy, "get_gpu_info")[0]["memory_allocated_mb"] * 2**20


def test_tensor_and_sequence_parallel_on_two_gpus(ray_session: None, tiny_tokenizer: Any) -> None:
    from rlcore.policy import Policy

    cluster = _gpu_cluster(2)
    model = model_dir("llama")
    data = make_data(tiny_tokenizer)
    try:
        policy = Policy(
            cluster,
            policy_config(model, world=2, tp=2, sp=True, use_gpu=True),
            tiny_tokenizer,
            name_prefix="dt-gpu-tp",
            init_reference_model=False,
        )
        try:
            assert _f64_error(model, data, policy.get_logprobs(data)["logprobs"]) <= ATOL
            _, expected = oracle_step(model, data, NLLLoss())
            out = policy.train(data, NLLLoss())
            assert abs(float(out["loss"][0]) - expected.loss) <= 1e-5 * abs(expected.loss)
            worst, name = max_abs_diff(full_weights(policy), expected.weights)
            assert worst <= STEP_ATOL, name
        finally:
            policy.shutdown()
    finally:
        cluster.shutdown()


def test_context_parallel_is_refused_clearly_on_gpus(ray_session: None, tiny_tokenizer: Any) -> None:
    from rlcore.distributed import WorkerError
    from rlcore.policy import Policy

    cluster = _gpu_cluster(2)
    try:
        cfg = policy_config(model_dir("llama"), world=2, use_gpu=True, dtensor_cfg={"context_parallel_size": 2})
        with pytest.raises(WorkerError, match="context_parallel_size=2: context parallel is not implemented"):
            Policy(cluster, cfg, tiny_tokenizer, name_prefix="dt-gpu-cp")
    finally:
        cluster.shutdown()
