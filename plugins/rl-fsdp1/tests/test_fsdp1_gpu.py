"""fsdp1's CUDA-only paths (skipped without CUDA); the cross-backend checks are tests/backends/test_backends_gpu.py.

FSDP1's own parameter offload (``CPUOffload(offload_params=True)``) only exists with an
accelerator: on a CPU machine ``fsdp_offload_enabled`` is a documented no-op. On one GPU:

- logprobs equal a float64 Hugging Face recomputation, one step of two micro-batches equals the
  single-process step (FSDP1's offload alone would keep the last micro-batch's gradient only), and
  the parameters really live in host memory between passes (the GPU holds at least a model's bytes
  less than without offload);
- greedy ``generate`` (HF ``generate`` inside ``summon_full_params``) gives the tokens the same
  weights give in a plain HF model on CPU, with logprobs equal to ``get_logprobs``.

Never what CI depends on: run on a GPU machine with ``make gpu-check``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rlcore.algorithms.loss_functions import NLLLoss
from rlcore.data import BatchedDataDict
from rlcore.testing.conformance import generation_output_problems, single_process_sgd, weight_problems
from rlcore.testing.models import make_batch, tiny_model_path
from tests.support.support_gpu import NO_RAY, missing

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(missing("ray"), reason=NO_RAY),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

ATOL = 1e-5
STEP_RTOL = 1e-4
LR = 0.5
MAX_NEW_TOKENS = 8


def _config(model: str, offload: bool = True) -> Any:
    from rlcore.config import load_config_dict

    return load_config_dict(
        {
            "cluster": {"workers_per_node": 1, "use_gpu": True},
            "policy": {
                "backend": "fsdp1",
                "model_name": model,
                "train_global_batch_size": 4,
                "train_micro_batch_size": 2,
                "logprob_batch_size": 2,
                "max_grad_norm": None,
                "fsdp_offload_enabled": offload,
                "optimizer": {"name": "torch.optim.SGD", "kwargs": {"lr": LR}},
                "generation": {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 1.0},
            },
        }
    ).policy


def _call(policy: Any, method: str, *args: Any) -> list[Any]:
    wg = policy.worker_group
    return wg.get_results(wg.run_all_workers_single_data(method, *args))


def _gpu_bytes(policy: Any) -> float:
    return _call(policy, "get_gpu_info")[0]["memory_allocated_mb"] * 2**20


def test_fsdp_param_offload_on_one_gpu(ray_session: None, tiny_tokenizer: Any) -> None:
    from rlcore.distributed import RayVirtualCluster
    from rlcore.policy import Policy
    from rlcore.testing.oracle import load_hf_model
    from tests.support.support_gpu import check_offload_frees_the_model, record, token_logprobs_f64, valid_error

    model = tiny_model_path(arch="llama", num_heads=4, num_kv_heads=2)
    data = BatchedDataDict(make_batch(tiny_tokenizer, 4, 5, 16, seed=2))
    cluster = RayVirtualCluster([1], use_gpus=True)
    try:
        policy = Policy(
            cluster, _config(model), tiny_tokenizer, name_prefix="fsdp1-gpu-offload", init_reference_model=False
        )
        try:
            assert _call(policy, "report_device_id")[0].startswith("cuda")
            assert _call(policy, "report_notes")[0] == [], "offload must take effect on a GPU"
            err, _ = valid_error(
                policy.get_logprobs(data)["logprobs"], token_logprobs_f64(model, data), data["input_lengths"]
            )
            record("fsdp1_offload_logprobs_vs_hf_f64_max_abs", err, tolerance=ATOL)
            assert err <= ATOL

            initial, (expected,) = single_process_sgd(model, [(data, NLLLoss())], LR)
            out = policy.train(data, NLLLoss())
            assert abs(float(out["loss"][0]) - expected.loss) <= 1e-5 * abs(expected.loss)
            on_gpu = _gpu_bytes(policy)
            weights = _call(policy, "export_full_state_dict")[0]
            problems = weight_problems(weights, expected.weights, initial, rtol=STEP_RTOL)
            assert not problems, "\n".join(problems)

            # Greedy generation on the GPU with the trained weights vs plain HF on CPU.
            raw = make_batch(tiny_tokenizer, 4, 2, 9, seed=5)
            prompts = BatchedDataDict(input_ids=raw["input_ids"], input_lengths=raw["input_lengths"])
            gen = policy.generate(prompts, greedy=True)
            problems = generation_output_problems(
                prompts["input_ids"], prompts["input_lengths"], gen, MAX_NEW_TOKENS, tiny_tokenizer.pad_token_id
            )
            assert not problems, "\n".join(problems)
            hf = load_hf_model(model)
            hf.load_state_dict(expected.weights)
            hf.eval()
            for i, length in enumerate(prompts["input_lengths"].tolist()):
                want = hf.generate(
                    prompts["input_ids"][i : i + 1, :length],
                    attention_mask=torch.ones(1, length).long(),
                    max_new_tokens=MAX_NEW_TOKENS,
                    do_sample=False,
                    eos_token_id=2,
                    pad_token_id=0,
                )
                n = int(gen["generation_lengths"][i])
                assert gen["output_ids"][i, length : length + n].tolist() == want[0, length:].tolist()[:n], i
            sequences = BatchedDataDict(input_ids=gen["output_ids"], input_lengths=gen["unpadded_sequence_lengths"])
            policy_lp = policy.get_logprobs(sequences)["logprobs"]
            generated = torch.arange(gen["output_ids"].shape[1])[None] >= prompts["input_lengths"][:, None]
            err = float(((gen["logprobs"] - policy_lp).abs() * generated).max())
            record("fsdp1_generation_vs_get_logprobs_max_abs", err, tolerance=ATOL)
            assert err <= ATOL
        finally:
            policy.shutdown()

        plain = Policy(
            cluster,
            _config(model, offload=False),
            tiny_tokenizer,
            name_prefix="fsdp1-gpu-no-offload",
            init_reference_model=False,
        )
        try:
            plain.train(data, NLLLoss())
            plain_on_gpu = _gpu_bytes(plain)
        finally:
            plain.shutdown()
        check_offload_frees_the_model("fsdp1_offload_gpu_bytes_between_steps", on_gpu, plain_on_gpu, model)
    finally:
        cluster.shutdown()
