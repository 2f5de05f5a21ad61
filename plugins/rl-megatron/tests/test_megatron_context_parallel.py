"""Context parallelism (``policy.megatron_cfg.context_parallel_size``) at CP 2 on 2 CPU/gloo ranks, through
``rlcore.policy.Policy`` (real Ray workers), on megatron-core's local layer spec (:mod:`rl_megatron.context_parallel`).

Qwen3 with tied embeddings; each rank holds 2 of the 4 chunks of every micro-batch (chunks r and 3-r), attention
all-gathers keys and values over CP. ``make_sequence_length_divisible_by`` is 1 and the batch has lengths 15, 13,
6, 8: the worker pads to a multiple of 4. Compared with a single-process HF float32 model: the logprobs, and one
plain-SGD NLL step (loss, gradient norm, every updated weight read back from the HF checkpoint the policy saves).
Tolerance 1e-5 (absolute for logprobs, relative for loss and gradient norm, of the largest update for weights,
:func:`rlcore.testing.oracle.weight_problems`).

Negative control, in the same run: the keys' and values' gradients are no longer summed over the CP group
(``cp_control_worker``); a second step, compared with the single-process step from the first step's weights,
must then differ.

CP 2 × PP 2 on 4 ranks (a 2-layer Qwen3, one layer per stage): the pipeline sends each stage's activations of the
rank's own positions (``seq_length / cp``), every stage gathers keys and values over its CP pair, the last stage
gathers the logits. The same step against the same single-process reference and tolerance, and the same negative
control (both stages' attention projections then differ).
"""

from __future__ import annotations

from typing import Any

import pytest
from megatron_helpers import (
    SGD_LR,
    batch,
    call_workers,
    hf_logprobs,
    max_valid_diff,
    model_dir,
    policy_config,
    state_of,
)

from rlcore.testing.conformance import single_process_sgd, weight_problems

pytest_plugins = ["rlcore.testing.pytest_plugin"]
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning")]

ATOL = 1e-5
CP = {"context_parallel_size": 2}


def control_plugin() -> Any:
    from rl_megatron.plugin import MEGATRON_SPEC
    from rlcore.plugins import hookimpl

    spec = MEGATRON_SPEC.model_copy(update={"worker_class": "cp_control_worker:KeyValueGradientSwitchWorker"})

    class SpecPlugin:
        @hookimpl
        def rlcore_register_backends(self, register: Any) -> None:
            register(spec)

    return SpecPlugin()


@pytest.fixture(scope="module")
def run(ray_session: None, tiny_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Logprobs, a step, then (K/V gradients not summed over CP) a second step, each with its reference."""
    from rlcore.algorithms.loss_functions import NLLLoss
    from rlcore.policy import Policy
    from rlcore.testing.pytest_plugin import ClusterPool, isolated_registry

    root = tmp_path_factory.mktemp("cp")
    model, data = model_dir("qwen3", tied=True), batch(tiny_tokenizer)
    pool = ClusterPool()
    try:
        with isolated_registry() as registry:
            registry.register_plugin(control_plugin(), name="megatron-cp-control")
            config = policy_config(model, 2, megatron=CP)
            policy = Policy(pool(2), config, tiny_tokenizer, name_prefix="cp", init_reference_model=False)
            try:
                logprobs = policy.get_logprobs(data)["logprobs"]
                first = policy.train(data, NLLLoss())
                policy.save_checkpoint(str(root / "first"))
                call_workers(policy, "stop_summing_key_value_gradients")
                policy.train(data, NLLLoss())
                policy.save_checkpoint(str(root / "control"))
            finally:
                policy.shutdown()
    finally:
        pool.shutdown()
    initial, (step,) = single_process_sgd(model, [(data, NLLLoss())], SGD_LR)
    after_first, (second_step,) = single_process_sgd(str(root / "first"), [(data, NLLLoss())], SGD_LR)
    return {
        "batch": data,
        "logprobs": logprobs,
        "hf_logprobs": hf_logprobs(model, data),
        "loss": float(first["loss"][0]),
        "grad_norm": float(first["grad_norm"][0]),
        "weights": state_of(str(root / "first")),
        "reference": (initial, step),
        "control_weights": state_of(str(root / "control")),
        "control_reference": (after_first, second_step),
    }


@pytest.fixture(scope="module")
def cp_pp_run(ray_session: None, tiny_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """CP 2 × PP 2 on 4 ranks: logprobs and one step, with the single-process reference."""
    from rlcore.algorithms.loss_functions import NLLLoss
    from rlcore.policy import Policy
    from rlcore.testing.pytest_plugin import ClusterPool, isolated_registry

    root = tmp_path_factory.mktemp("cp-pp")
    model, data = model_dir("qwen3", tied=True), batch(tiny_tokenizer)
    pool = ClusterPool()
    try:
        with isolated_registry() as registry:
            registry.register_plugin(control_plugin(), name="megatron-cp-pp-control")
            config = policy_config(model, 4, megatron={**CP, "pipeline_model_parallel_size": 2})
            policy = Policy(pool(4), config, tiny_tokenizer, name_prefix="cp-pp", init_reference_model=False)
            try:
                logprobs = policy.get_logprobs(data)["logprobs"]
                first = policy.train(data, NLLLoss())
                policy.save_checkpoint(str(root / "first"))
                call_workers(policy, "stop_summing_key_value_gradients")
                policy.train(data, NLLLoss())
                policy.save_checkpoint(str(root / "control"))
            finally:
                policy.shutdown()
    finally:
        pool.shutdown()
    initial, (step,) = single_process_sgd(model, [(data, NLLLoss())], SGD_LR)
    after_first, (second_step,) = single_process_sgd(str(root / "first"), [(data, NLLLoss())], SGD_LR)
    return {
        "batch": data,
        "logprobs": logprobs,
        "hf_logprobs": hf_logprobs(model, data),
        "loss": float(first["loss"][0]),
        "grad_norm": float(first["grad_norm"][0]),
        "weights": state_of(str(root / "first")),
        "reference": (initial, step),
        "control_weights": state_of(str(root / "control")),
        "control_reference": (after_first, second_step),
    }


def test_logprobs_match_hf(run: dict) -> None:
    lengths = run["batch"]["input_lengths"]
    assert {int(n) % 4 for n in lengths} != {0}, lengths  # the worker pads to a multiple of 2·cp
    assert max_valid_diff(run["logprobs"], run["hf_logprobs"], lengths) <= ATOL


def test_train_step_matches_single_process_sgd(run: dict) -> None:
    initial, expected = run["reference"]
    assert abs(run["loss"] - expected.loss) <= ATOL * abs(expected.loss), (run["loss"], expected.loss)
    assert abs(run["grad_norm"] - expected.grad_norm) <= ATOL * expected.grad_norm, (run["grad_norm"], expected)
    problems = weight_problems(run["weights"], expected.weights, initial, ATOL)
    assert not problems, "\n".join(problems)


def test_key_value_gradients_not_summed_over_cp_fail_parity(run: dict) -> None:
    """The negative control: the attention projections' updated weights differ from the reference."""
    initial, expected = run["control_reference"]
    problems = weight_problems(run["control_weights"], expected.weights, initial, ATOL)
    assert any("self_attn" in line for line in problems), problems


def test_cp2_pp2_logprobs_match_hf(cp_pp_run: dict) -> None:
    lengths = cp_pp_run["batch"]["input_lengths"]
    assert max_valid_diff(cp_pp_run["logprobs"], cp_pp_run["hf_logprobs"], lengths) <= ATOL


def test_cp2_pp2_train_step_matches_single_process_sgd(cp_pp_run: dict) -> None:
    initial, expected = cp_pp_run["reference"]
    loss, grad_norm = cp_pp_run["loss"], cp_pp_run["grad_norm"]
    assert abs(loss - expected.loss) <= ATOL * abs(expected.loss), (loss, expected.loss)
    assert abs(grad_norm - expected.grad_norm) <= ATOL * expected.grad_norm, (grad_norm, expected.grad_norm)
    problems = weight_problems(cp_pp_run["weights"], expected.weights, initial, ATOL)
    assert not problems, "\n".join(problems)


def test_cp2_pp2_key_value_gradients_not_summed_over_cp_fail_parity(cp_pp_run: dict) -> None:
    """The negative control of the CP 2 x PP 2 run: both stages' attention runs over CP (its K/V gradients matter)."""
    initial, expected = cp_pp_run["control_reference"]
    problems = weight_problems(cp_pp_run["control_weights"], expected.weights, initial, ATOL)
    assert any("layers.0.self_attn" in line for line in problems), problems
    assert any("layers.1.self_attn" in line for line in problems), problems
