"""megatron's CUDA-only paths (skipped without CUDA); the cross-backend checks are tests/backends/test_backends_gpu.py.

On one GPU:

- megatron-core runs with none of ``cpu_compat``'s redirects, on Qwen2 with tied embeddings
  (QKV bias, the tied output layer's gradient): logprobs equal a float64 HF recomputation and one
  step equals the single-process step.

Two GPUs (skipped with fewer): TP=2, TP=2 with sequence parallelism (make_sequence_length_divisible_by 1: the
worker pads to a multiple of TP), and PP=2 over NCCL against the same references.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from megatron_helpers import SGD_LR, batch, call_workers, model_dir, policy_config

from tests.support.support_gpu import NO_MEGATRON, NO_RAY, missing

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(missing("ray"), reason=NO_RAY),
    pytest.mark.skipif(missing("megatron.core"), reason=NO_MEGATRON),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

ATOL = 1e-5
STEP_RTOL = 1e-4


def _check_against_references(policy: Any, model: str, data: Any, what: str) -> None:
    from rlcore.algorithms.loss_functions import NLLLoss
    from rlcore.testing.conformance import single_process_sgd, weight_problems
    from tests.support.support_gpu import record, token_logprobs_f64, valid_error

    err, _ = valid_error(policy.get_logprobs(data)["logprobs"], token_logprobs_f64(model, data), data["input_lengths"])
    record(f"{what}_logprobs_vs_hf_f64_max_abs", err, tolerance=ATOL)
    assert err <= ATOL, f"{what}: logprobs differ from float64 HF by {err:.3g}"
    initial, (expected,) = single_process_sgd(model, [(data, NLLLoss())], SGD_LR)
    out = policy.train(data, NLLLoss())
    assert abs(float(out["loss"][0]) - expected.loss) <= 1e-5 * abs(expected.loss)
    weights = call_workers(policy, "hf_state_dict")[0]
    # Tied embeddings: the export names the shared tensor once, as save_pretrained does.
    expected_weights = {k: v for k, v in expected.weights.items() if k in weights or k != "lm_head.weight"}
    problems = weight_problems(weights, expected_weights, initial, rtol=STEP_RTOL)
    assert not problems, "\n".join(problems)


def test_one_gpu_without_cpu_redirects_tied_qwen2(make_cluster: Any, tiny_tokenizer: Any) -> None:
    from rlcore.policy import Policy

    model = model_dir("qwen2", tied=True)
    config = policy_config(model, 1)  # the cluster (use_gpus=True) puts the worker on a GPU
    policy = Policy(
        make_cluster(1, use_gpus=True), config, tiny_tokenizer, name_prefix="megatron-gpu", init_reference_model=False
    )
    try:
        assert call_workers(policy, "redirected_call_sites") == [None], "cpu_compat must be inactive on a GPU"
        assert call_workers(policy, "report_device_id")[0].startswith("cuda")
        _check_against_references(policy, model, batch(tiny_tokenizer), "megatron_qwen2_tied")
    finally:
        policy.shutdown()


@pytest.mark.parametrize(
    "layout",
    [
        {"tensor_model_parallel_size": 2},
        {"tensor_model_parallel_size": 2, "sequence_parallel": True},
        {"pipeline_model_parallel_size": 2},
    ],
    ids=["tp2", "tp2-sp", "pp2"],
)
def test_two_gpus(make_cluster: Any, tiny_tokenizer: Any, layout: dict) -> None:
    from rlcore.policy import Policy

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    model = model_dir("llama")
    policy = Policy(
        make_cluster(2, use_gpus=True),
        policy_config(model, 2, megatron=layout),
        tiny_tokenizer,
        name_prefix="megatron-gpu2",
        init_reference_model=False,
    )
    try:
        _check_against_references(
            policy, model, batch(tiny_tokenizer), f"megatron_{'_'.join(map(str, layout.values()))}"
        )
    finally:
        policy.shutdown()
