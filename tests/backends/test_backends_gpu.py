"""The three training backends on one CUDA GPU, each checked against an independent reference.

For each of ``dtensor`` (FSDP2 + DTensor), ``fsdp1`` and ``megatron`` (skipped when megatron-core
is not installed), one float32 policy on one GPU (a one-bundle cluster with room for colocated
groups) is started once, and:

- its float32 logprobs equal a float64 Hugging Face recomputation on CPU within ``FP32_ATOL``;
- a bf16 policy's logprobs are within ``BF16_MAX_ATOL`` (max) / ``BF16_MEAN_ATOL`` (mean) of that
  float64 recomputation, and farther than float32 round-off (bf16 was really used);
- one optimizer step (SGD, two micro-batches) equals the single-process CPU step: loss, gradient
  norm, and every weight of the HF checkpoint the GPU workers saved, read back on CPU;
- an HF checkpoint written on CPU loads into the GPU workers (logprobs equal the float64
  recomputation of that checkpoint);
- weights + optimizer state saved on the GPU resume on a CPU policy and the reverse, each
  continuing exactly as the other side does (momentum SGD: a lost optimizer state shows);
- a CUDA IPC refit into a Hugging Face model in another process on the same GPU leaves that
  model's logprobs equal to the policy's, twice (pooled buffers, reopened handles);
- the offload hooks move GPU memory (``torch.cuda.memory_allocated`` in the worker, asserted
  against the model's size) and bring it back without changing a logprob.

Tolerances are stated as constants below; measured values are kept with
:func:`tests.support.support_gpu.record` for the gpu-check summary. Multi-GPU cases live elsewhere,
marked and skipped with fewer GPUs.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.support_gpu import NO_MEGATRON, NO_RAY, HFReceiver, missing, record, token_logprobs_f64, valid_error

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(missing("ray"), reason=NO_RAY),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

BACKENDS = ("dtensor", "fsdp1", "megatron")
#: float32 logprobs on the GPU vs the float64 recomputation on CPU (max over valid positions).
FP32_ATOL = 1e-5
#: bf16 (weights or compute) logprobs vs the float64 recomputation: max and mean over valid positions.
BF16_MAX_ATOL = 2e-2
BF16_MEAN_ATOL = 5e-3
#: bf16 must differ from float64 by more than float32 round-off, or bf16 was not used.
BF16_MIN_ERR = 1e-5
#: Weights after a step: max error per tensor relative to the largest update (conformance kit's measure).
STEP_RTOL = 1e-4
#: Loss and gradient norm of a step vs the single-process step (relative).
LOSS_RTOL = 1e-5
GRAD_NORM_RTOL = 1e-4
#: Offloading must free at least this fraction of the bytes it is expected to move.
MOVED_FRACTION = 0.9
LR = 0.5
MOMENTUM = 0.9
#: Small buckets: a refit of the tiny model takes many buckets and reuses both buffers.
REFIT_BUCKET_BYTES = 64 << 10
#: Colocated groups per bundle: the float32 policy, the receiver, the bf16 policy, one spare.
SLOTS = 4


def model_path() -> str:
    """The tiny Llama of the GPU tests: 4 query / 2 KV heads (the dtensor and megatron suites' shape)."""
    from rlcore.testing.models import tiny_model_path

    return tiny_model_path(arch="llama", num_heads=4, num_kv_heads=2)


def policy_config(backend: str, *, precision: str = "float32", use_gpu: bool = True) -> Any:
    from rlcore.config import load_config_dict

    raw: dict[str, Any] = {
        "backend": backend,
        "model_name": model_path(),
        "train_global_batch_size": 4,
        "train_micro_batch_size": 2,
        "logprob_batch_size": 2,
        "max_grad_norm": None,
        "precision": precision,
        "max_total_sequence_length": 32,
        "learning_rate": LR if precision == "float32" else 1e-3,
    }
    half = precision != "float32"
    if backend == "megatron":
        # bf16: bf16 weights with float32 main weights in the optimizer (params_dtype's default).
        optimizer = (
            {"optimizer": "adam", "bf16": True, "weight_decay": 0.0}
            if half
            else {"optimizer": "sgd", "sgd_momentum": MOMENTUM, "weight_decay": 0.0}
        )
        raw["megatron_cfg"] = {
            "optimizer": optimizer,
            "scheduler": {"start_weight_decay": 0.0, "end_weight_decay": 0.0},
        }
    else:
        raw["optimizer"] = (
            {"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-3}}
            if half
            else {"name": "torch.optim.SGD", "kwargs": {"lr": LR, "momentum": MOMENTUM}}
        )
    return load_config_dict({"cluster": {"workers_per_node": 1, "use_gpu": use_gpu}, "policy": raw}).policy


def make_data(tokenizer: Any, seed: int) -> Any:
    from rlcore.data import BatchedDataDict
    from rlcore.testing.models import make_batch

    return BatchedDataDict(make_batch(tokenizer, 4, 5, 16, seed=seed))


def call_workers(policy: Any, method: str, *args: Any) -> list[Any]:
    group = policy.worker_group
    return group.get_results(group.run_all_workers_single_data(method, *args))


def num_params(path: str) -> int:
    from rlcore.testing.oracle import load_hf_model

    return sum(p.numel() for p in load_hf_model(path).parameters())


def gpu_bytes(policy: Any) -> float:
    """``torch.cuda.memory_allocated`` of the policy's worker, through rlcore's GPU memory metric."""
    info = call_workers(policy, "get_gpu_info")[0]
    assert "memory_allocated_mb" in info, f"get_gpu_info() of a GPU worker has no memory figures: {info}"
    return info["memory_allocated_mb"] * 2**20


def hf_weights(path: str) -> dict[str, torch.Tensor]:
    """A checkpoint's weights, loaded on CPU with ``AutoModelForCausalLM`` (fails on missing/extra names)."""
    from rlcore.testing.oracle import load_hf_model, state_copy

    weights = state_copy(load_hf_model(path))
    assert all(t.device.type == "cpu" for t in weights.values())
    return weights


def skip_unless_usable(backend: str) -> None:
    from rlcore.plugins import get_registry

    if backend == "megatron" and missing("megatron.core"):
        pytest.skip(NO_MEGATRON)
    record_ = get_registry().find(backend)
    assert record_.status == "ok", f"backend {backend} is {record_.status}: {record_.problem}"


class BackendEnv:
    """One backend's float32 policy on one GPU, with its first step taken and saved."""

    def __init__(self, backend: str, tokenizer: Any, tmp: Path) -> None:
        from rlcore.algorithms.loss_functions import NLLLoss
        from rlcore.distributed import RayVirtualCluster
        from rlcore.policy import Policy

        self.backend, self.tokenizer, self.tmp = backend, tokenizer, tmp
        self.cluster = RayVirtualCluster([1], use_gpus=True, max_colocated_worker_groups=SLOTS, name=f"gpu-{backend}")
        self.policy = None
        try:
            self.policy = Policy(
                self.cluster,
                policy_config(backend),
                tokenizer,
                name_prefix=f"gpu-{backend}",
                init_reference_model=False,
            )
            device = call_workers(self.policy, "report_device_id")[0]
            assert device.startswith("cuda"), f"the {backend} worker of a GPU cluster runs on {device}"
            self.data = make_data(tokenizer, seed=11)
            # Everything the tests compare with the initial weights is taken now, whatever runs first.
            self.initial_logprobs = self.policy.get_logprobs(self.data)["logprobs"]
            self.step1 = self.policy.train(self.data, NLLLoss())
            self.step1_weights = str(tmp / "step1" / "weights")
            self.step1_optimizer = str(tmp / "step1" / "optimizer")
            self.policy.save_checkpoint(self.step1_weights, self.step1_optimizer)
        except BaseException:
            self.close()
            raise

    def logprobs(self, data: Any = None) -> torch.Tensor:
        return self.policy.get_logprobs(self.data if data is None else data)["logprobs"]

    def close(self) -> None:
        if self.policy is not None:
            self.policy.shutdown()
        self.cluster.shutdown()


@pytest.fixture(scope="module", params=BACKENDS)
def env(
    request: pytest.FixtureRequest, ray_session: None, tiny_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[BackendEnv]:
    backend = request.param
    skip_unless_usable(backend)
    environment = BackendEnv(backend, tiny_tokenizer, tmp_path_factory.mktemp(f"gpu-{backend}"))
    yield environment
    environment.close()


# --------------------------------------------------------------------------- numerics


def test_fp32_logprobs_match_hf_float64(env: BackendEnv) -> None:
    from rlcore.testing.conformance import logprob_problems

    expected = token_logprobs_f64(model_path(), env.data)
    lengths = env.data["input_lengths"]
    assert not logprob_problems(env.initial_logprobs, lengths), "alignment/dtype contract (design.md §2.2)"
    worst, mean = valid_error(env.initial_logprobs, expected, lengths)
    record("fp32_logprobs_vs_hf_f64_max_abs", worst, backend=env.backend, tolerance=FP32_ATOL)
    record("fp32_logprobs_vs_hf_f64_mean_abs", mean, backend=env.backend)
    assert worst <= FP32_ATOL, f"{env.backend}: float32 logprobs on CUDA differ from float64 by {worst:.3g}"


def test_train_step_matches_single_process_and_loads_on_cpu(env: BackendEnv) -> None:
    """One step on the GPU equals the single-process CPU step; the GPU-saved HF checkpoint loads on CPU."""
    from rlcore.algorithms.loss_functions import NLLLoss
    from rlcore.testing.conformance import single_process_sgd, weight_problems

    initial, (expected,) = single_process_sgd(model_path(), [(env.data, NLLLoss())], LR)
    loss, grad_norm = float(env.step1["loss"][0]), float(env.step1["grad_norm"][0])
    record("step_loss_rel_err", abs(loss - expected.loss) / abs(expected.loss), backend=env.backend)
    record("step_grad_norm_rel_err", abs(grad_norm - expected.grad_norm) / expected.grad_norm, backend=env.backend)
    assert abs(loss - expected.loss) <= LOSS_RTOL * abs(expected.loss), (loss, expected.loss)
    assert abs(grad_norm - expected.grad_norm) <= GRAD_NORM_RTOL * expected.grad_norm, (grad_norm, expected.grad_norm)
    problems = weight_problems(hf_weights(env.step1_weights), expected.weights, initial, rtol=STEP_RTOL)
    assert not problems, "\n".join(problems)


def test_bf16_policy_logprobs_and_training(env: BackendEnv) -> None:
    """bf16 on the GPU: logprobs within the stated tolerance of float64, Adam steps, offload round trip."""
    from rlcore.algorithms.loss_functions import NLLLoss
    from rlcore.policy import Policy

    policy = Policy(
        env.cluster,
        policy_config(env.backend, precision="bfloat16"),
        env.tokenizer,
        name_prefix=f"gpu-{env.backend}-bf16",
        init_reference_model=False,
    )
    try:
        lengths = env.data["input_lengths"]
        got = policy.get_logprobs(env.data)["logprobs"]
        assert got.dtype == torch.float32
        worst, mean = valid_error(got, token_logprobs_f64(model_path(), env.data), lengths)
        record("bf16_logprobs_vs_hf_f64_max_abs", worst, backend=env.backend, tolerance=BF16_MAX_ATOL)
        record("bf16_logprobs_vs_hf_f64_mean_abs", mean, backend=env.backend, tolerance=BF16_MEAN_ATOL)
        assert worst <= BF16_MAX_ATOL and mean <= BF16_MEAN_ATOL, (worst, mean)
        assert worst > BF16_MIN_ERR, f"bf16 logprobs equal float64 to {worst:.2g}: the bf16 path was not taken"
        info = policy.prepare_refit_info()
        assert {dtype for _, dtype in info.values()} == {"bfloat16"}, "refit should send the bf16 compute weights"

        first = policy.train(env.data, NLLLoss())
        assert torch.isfinite(first["loss"]).all() and float(first["grad_norm"][0]) > 0
        trained = policy.get_logprobs(env.data)["logprobs"]
        assert not torch.equal(trained, got), "an Adam step changed no logprob"
        # The memory hooks around a refit, then training again (optimizer state moved back and forth).
        policy.offload_before_refit()
        policy.offload_after_refit()
        policy.prepare_for_training()
        assert torch.equal(policy.get_logprobs(env.data)["logprobs"], trained), "offload round trip changed weights"
        second = policy.train(env.data, NLLLoss())
        assert torch.isfinite(second["loss"]).all() and float(second["loss"][0]) < float(first["loss"][0])
        peak = call_workers(policy, "get_gpu_info")[0]["peak_memory_allocated_mb"]
        record("bf16_policy_peak_memory_mb", peak, backend=env.backend)
        _check_bf16_refit(env, policy)
    finally:
        policy.shutdown()


def _check_bf16_refit(env: BackendEnv, policy: Any) -> None:
    """A bf16 policy refits a bf16 engine: every tensor arrives in the dtype its metadata names (megatron
    keeps its norms in float32 beside bf16 weights and once sent them so), and the engine then computes
    the policy's logprobs to bf16 accuracy."""
    from rlcore.refit import WeightSynchronizer

    lengths = env.data["input_lengths"]
    receiver = HFReceiver(env.cluster, model_path(), dtype="bfloat16", name_prefix=f"receiver-bf16-{env.backend}")
    try:
        policy_lp = policy.get_logprobs(env.data)["logprobs"]
        before, _ = valid_error(receiver.logprobs(env.data), policy_lp, lengths)
        WeightSynchronizer(policy, receiver, colocated=True, bucket_bytes=REFIT_BUCKET_BYTES).sync_weights()
        after, _ = valid_error(receiver.logprobs(env.data), policy_lp, lengths)
        record(
            "bf16_refit_receiver_vs_policy_max_abs",
            after,
            backend=env.backend,
            before_refit=before,
            tolerance=BF16_MAX_ATOL,
        )
        assert after <= BF16_MAX_ATOL, (before, after)
    finally:
        receiver.shutdown()


# --------------------------------------------------------------------------- checkpoints across devices


def test_checkpoint_saved_on_cpu_loads_on_gpu(env: BackendEnv) -> None:
    from rlcore.testing.oracle import load_hf_model, state_copy
    from rlcore.training.checkpoint import save_hf_checkpoint

    model = load_hf_model(model_path())
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=generator))
    path = env.tmp / "saved_on_cpu"
    save_hf_checkpoint(state_copy(model), model.config, path)  # rlcore's writer, in this CPU process
    call_workers(env.policy, "load_checkpoint", str(path))
    worst, _ = valid_error(env.logprobs(), token_logprobs_f64(str(path), env.data), env.data["input_lengths"])
    record("cpu_saved_checkpoint_logprobs_max_abs", worst, backend=env.backend, tolerance=FP32_ATOL)
    assert worst <= FP32_ATOL, f"{env.backend}: the CPU-written checkpoint loaded on the GPU gives error {worst:.3g}"


def _hide_gpu_from_cpu_clusters(monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers of a CPU cluster must not see the GPU.

    Ray (>= 2.4x) leaves ``CUDA_VISIBLE_DEVICES`` alone for actors that ask for no GPU, and the
    backends pick CUDA whenever ``torch.cuda.is_available()``; ``tests/distributed/test_cuda_runtime_gpu.py``
    checks that rlcore does this itself. Here the policy's worker group is given an empty
    ``CUDA_VISIBLE_DEVICES`` so that this test checks checkpoints, not that.
    """
    import rlcore.policy.lm_policy as lm_policy

    original = lm_policy.RayWorkerGroup

    def worker_group(cluster: Any, worker_class: str, **kwargs: Any) -> Any:
        if not cluster.use_gpus:
            kwargs["extra_env"] = {**(kwargs.get("extra_env") or {}), "CUDA_VISIBLE_DEVICES": ""}
        return original(cluster, worker_class, **kwargs)

    monkeypatch.setattr(lm_policy, "RayWorkerGroup", worker_group)


def test_checkpoints_resume_across_gpu_and_cpu(env: BackendEnv, monkeypatch: pytest.MonkeyPatch) -> None:
    """Weights + optimizer state saved on the GPU continue on a CPU policy, and the reverse.

    Momentum SGD: a step that lost the optimizer state differs from the real one by about the
    size of the update, far beyond ``STEP_RTOL``.
    """
    from rlcore.algorithms.loss_functions import NLLLoss
    from rlcore.distributed import RayVirtualCluster
    from rlcore.policy import Policy
    from rlcore.testing.conformance import weight_problems

    _hide_gpu_from_cpu_clusters(monkeypatch)
    cpu_cluster = RayVirtualCluster([1], name=f"cpu-{env.backend}")
    cpu = None
    try:
        cpu = Policy(
            cpu_cluster,
            policy_config(env.backend, use_gpu=False),
            env.tokenizer,
            name_prefix=f"cpu-{env.backend}",
            weights_path=env.step1_weights,
            optimizer_path=env.step1_optimizer,
            init_reference_model=False,
        )
        assert call_workers(cpu, "report_device_id")[0] == "cpu"
        paths = {name: str(env.tmp / "resume" / name) for name in ("cpu2", "cpu2_opt", "gpu2", "cpu3", "gpu3")}

        # GPU -> CPU: step 2 on the CPU from the GPU's step-1 checkpoint, vs the GPU from the same.
        data2, data3 = make_data(env.tokenizer, seed=12), make_data(env.tokenizer, seed=13)
        cpu.train(data2, NLLLoss())
        cpu.save_checkpoint(paths["cpu2"], paths["cpu2_opt"])
        call_workers(env.policy, "load_checkpoint", env.step1_weights, env.step1_optimizer)
        env.policy.train(data2, NLLLoss())
        env.policy.save_checkpoint(paths["gpu2"])
        problems = weight_problems(
            hf_weights(paths["cpu2"]),
            hf_weights(paths["gpu2"]),
            hf_weights(env.step1_weights),
            rtol=STEP_RTOL,
            what="GPU->CPU resume",
        )

        # CPU -> GPU: the GPU loads the CPU's step-2 checkpoint; both take step 3.
        call_workers(env.policy, "load_checkpoint", paths["cpu2"], paths["cpu2_opt"])
        env.policy.train(data3, NLLLoss())
        env.policy.save_checkpoint(paths["gpu3"])
        cpu.train(data3, NLLLoss())
        cpu.save_checkpoint(paths["cpu3"])
        problems += weight_problems(
            hf_weights(paths["gpu3"]),
            hf_weights(paths["cpu3"]),
            hf_weights(paths["cpu2"]),
            rtol=STEP_RTOL,
            what="CPU->GPU resume",
        )
        assert not problems, "\n".join(problems)
    finally:
        if cpu is not None:
            cpu.shutdown()
        cpu_cluster.shutdown()


# --------------------------------------------------------------------------- refit and memory


def test_cuda_ipc_refit_into_another_process(env: BackendEnv) -> None:
    """Colocated refit on one GPU: CUDA IPC buffers, every tensor, logprobs equal afterwards (twice)."""
    from rlcore.algorithms.loss_functions import NLLLoss
    from rlcore.refit import WeightSynchronizer

    lengths = env.data["input_lengths"]
    receiver = HFReceiver(env.cluster, model_path(), name_prefix=f"receiver-{env.backend}")
    try:
        sync = WeightSynchronizer(env.policy, receiver, colocated=True, bucket_bytes=REFIT_BUCKET_BYTES)
        assert sync.transport == "shared_memory"
        for round_ in range(2):
            env.policy.train(make_data(env.tokenizer, seed=20 + round_), NLLLoss())
            policy_lp = env.logprobs()
            before, _ = valid_error(receiver.logprobs(env.data), policy_lp, lengths)
            assert before > 1e-3, "the receiver already had the policy's weights: the test would prove nothing"
            stats = sync.sync_weights()
            got = receiver.last_receive()
            assert got["devices"] == ["cuda"], f"the receiver got {got['devices']} buffers, not CUDA IPC ones"
            assert set(got["names"]) == set(env.policy.prepare_refit_info()) and got["buckets"] > 2
            worst, _ = valid_error(receiver.logprobs(env.data), policy_lp, lengths)
            record(
                "ipc_refit_receiver_vs_policy_max_abs",
                worst,
                backend=env.backend,
                round=round_,
                tolerance=FP32_ATOL,
                bytes=stats["bytes"],
                seconds=stats["seconds"],
            )
            assert worst <= FP32_ATOL, f"round {round_}: receiver logprobs differ from the policy's by {worst:.3g}"
    finally:
        receiver.shutdown()


def test_offload_hooks_move_gpu_memory(env: BackendEnv) -> None:
    """offload_before_refit frees the optimizer state, offload_after_refit the weights (dtensor, fsdp1)
    or gradient buffers (megatron), prepare_for_training brings them back, and no logprob changes.

    The optimizer is momentum SGD: its state is one float32 tensor per parameter.
    """
    from rlcore.algorithms.loss_functions import NLLLoss

    expected_bytes = 4 * num_params(model_path())  # one float32 copy of the model
    policy = env.policy
    policy.prepare_for_training()
    before_lp = env.logprobs()
    full = gpu_bytes(policy)
    policy.offload_before_refit()
    mid = gpu_bytes(policy)
    policy.offload_after_refit()
    low = gpu_bytes(policy)
    policy.prepare_for_training()
    back = gpu_bytes(policy)
    record(
        "offload_bytes",
        {
            "full": full,
            "after_offload_before_refit": mid,
            "after_offload_after_refit": low,
            "after_prepare_for_training": back,
            "model_fp32_bytes": expected_bytes,
        },
        backend=env.backend,
    )
    assert full - mid >= MOVED_FRACTION * expected_bytes, (
        f"offload_before_refit freed {full - mid:.0f} B; the optimizer state is {expected_bytes} B"
    )
    assert full - low >= MOVED_FRACTION * 2 * expected_bytes, (
        f"after offload_after_refit only {full - low:.0f} B are free; expected >= 2 x {expected_bytes} B"
    )
    assert back - low >= MOVED_FRACTION * 2 * expected_bytes, (
        f"prepare_for_training brought back {back - low:.0f} B; expected >= 2 x {expected_bytes} B"
    )
    assert torch.equal(env.logprobs(), before_lp), "weights changed across the offload round trip"
    result = policy.train(env.data, NLLLoss())
    assert torch.isfinite(result["loss"]).all()
