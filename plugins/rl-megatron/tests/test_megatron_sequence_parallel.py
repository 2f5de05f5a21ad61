"""Sequence parallelism (``policy.megatron_cfg.sequence_parallel``) at TP 2 on CPU/gloo, through
``rlcore.policy.Policy`` (real Ray workers).

Qwen3 (its q/k norms see the full sequence, its input / pre-MLP / final norms only their rank's half) with tied
embeddings, TP 2 with sequence parallelism, compared with a single-process HF float32 model: the logprobs, and one
plain-SGD NLL step (loss, gradient norm, every updated weight read back from the HF checkpoint the policy saves).
``make_sequence_length_divisible_by`` is 1 (NeMo-RL's SP recipes) and the batch has odd lengths: the worker pads
each micro-batch to a multiple of tp and cuts the results back.
The TP 2 run without sequence parallelism is held to the same reference, at the same tolerance, in
test_megatron_parallel.py. Tolerance: 1e-5 (absolute for logprobs, relative for loss and gradient norm, of the
largest update for weights, :func:`rlcore.testing.oracle.weight_problems`).

Negative control, in the same run: the norms' ``sequence_parallel`` mark is taken off (``sp_switch_worker``), so
their gradients are no longer summed over TP, and a second step is compared with the single-process step from the
first step's weights: the norms' updated weights, and only theirs, must then differ.

``slow``: Qwen3-MoE at TP 2 + sequence parallelism + EP 2 against test_megatron_moe's float64 reference (the aux
loss gathers the routers' logits over the sequence shards; without that gather its aux loss is off by ~1%).
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
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

ATOL = 1e-5
SP = {"tensor_model_parallel_size": 2, "sequence_parallel": True}
#: the HF names of the norms that see a sequence shard under sequence parallelism
SHARDED_NORMS = ("input_layernorm.", "post_attention_layernorm.", "model.norm.")


@pytest.fixture(scope="module")
def pool(ray_session: None) -> Any:
    from rlcore.testing.pytest_plugin import ClusterPool

    clusters = ClusterPool()
    yield clusters
    clusters.shutdown()


def sp_policy(pool: Any, tokenizer: Any, model: str, name: str) -> Any:
    """A 2-rank TP 2 + sequence-parallel policy on ``sp_switch_worker`` (the production worker plus one method);
    call inside ``isolated_registry`` with ``switch_plugin`` registered."""
    from rlcore.policy import Policy

    # NeMo-RL's SP recipes' divisor: the worker pads each micro-batch to a multiple of tp itself
    config = policy_config(model, 2, megatron=SP, make_sequence_length_divisible_by=1)
    return Policy(pool(2), config, tokenizer, name_prefix=f"sp-{name}", init_reference_model=False)


def switch_plugin() -> Any:
    from rl_megatron.plugin import MEGATRON_SPEC
    from rlcore.plugins import hookimpl

    spec = MEGATRON_SPEC.model_copy(update={"worker_class": "sp_switch_worker:NormMarkSwitchWorker"})

    class SpecPlugin:
        @hookimpl
        def rlcore_register_backends(self, register: Any) -> None:
            register(spec)

    return SpecPlugin()


@pytest.fixture(scope="module")
def run(pool: Any, tiny_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Logprobs, a step, then (norms unmarked) a second step, each with its HF checkpoint and reference."""
    from rlcore.algorithms.loss_functions import NLLLoss
    from rlcore.testing.pytest_plugin import isolated_registry

    root = tmp_path_factory.mktemp("sp")
    model, data = model_dir("qwen3", tied=True), batch(tiny_tokenizer)
    with isolated_registry() as registry:
        registry.register_plugin(switch_plugin(), name="megatron-sp-switch")
        policy = sp_policy(pool, tiny_tokenizer, model, "qwen3")
        try:
            logprobs = policy.get_logprobs(data)["logprobs"]
            first = policy.train(data, NLLLoss())
            policy.save_checkpoint(str(root / "first"))
            redirected = call_workers(policy, "redirected_call_sites")
            unmarked = call_workers(policy, "unmark_sequence_parallel_norms")
            policy.train(data, NLLLoss())
            policy.save_checkpoint(str(root / "unmarked"))
        finally:
            policy.shutdown()
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
        "redirected": redirected,
        "unmarked": unmarked,
        "unmarked_weights": state_of(str(root / "unmarked")),
        "unmarked_reference": (after_first, second_step),
    }


def test_logprobs_match_hf(run: dict) -> None:
    lengths = run["batch"]["input_lengths"]
    # odd lengths (15, 13) are padded to 16 and 14 by the worker (7 positions per rank: an odd shard)
    assert {int(n) % 2 for n in lengths} == {0, 1}, lengths
    assert run["logprobs"].shape == run["hf_logprobs"].shape
    assert max_valid_diff(run["logprobs"], run["hf_logprobs"], lengths) <= ATOL


def test_train_step_matches_single_process_sgd(run: dict) -> None:
    initial, expected = run["reference"]
    assert abs(run["loss"] - expected.loss) <= ATOL * abs(expected.loss), (run["loss"], expected.loss)
    assert abs(run["grad_norm"] - expected.grad_norm) <= ATOL * expected.grad_norm, (run["grad_norm"], expected)
    problems = weight_problems(run["weights"], expected.weights, initial, ATOL)
    assert not problems, "\n".join(problems)


def test_only_listed_cuda_call_sites_were_redirected(run: dict) -> None:
    from rl_megatron.cpu_compat import CALL_SITES

    listed = {(s.module, s.function) for s in CALL_SITES}
    for rank, observed in enumerate(run["redirected"]):
        unlisted = {tuple(site) for site in observed} - listed
        assert observed and not unlisted, f"rank {rank}: redirected call sites missing from CALL_SITES: {unlisted}"


def test_norm_gradients_not_summed_over_tp_fail_parity(run: dict) -> None:
    """The negative control: the input, pre-MLP and final norms (2 layers: 5 weights) were the marked parameters;
    unmarked, their updated weights differ from the reference, and the q/k norms and linear layers still match."""
    for names in run["unmarked"]:
        assert len(names) == 5 and all("layernorm" in n for n in names), names
    initial, expected = run["unmarked_reference"]
    problems = weight_problems(run["unmarked_weights"], expected.weights, initial, ATOL)
    assert problems and all(any(norm in line for norm in SHARDED_NORMS) for line in problems), problems


@pytest.mark.slow  # a second policy start and a float64 MoE reference
def test_moe_step_matches_float64_reference(
    pool: Any, tiny_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Qwen3-MoE at TP 2 + sequence parallelism (each rank routes half of every sequence; the aux loss gathers
    the routers' logits) and EP 2: loss, aux loss, gradient norm and weights equal test_megatron_moe's float64
    reference at its tolerances. (EP 1 at TP 2 is refused: rl_megatron.config.moe_model_problems.)"""
    ep = 2
    from test_megatron_moe import LR, float64_reference, moe_model, parity_problems

    from rlcore.algorithms.loss_functions import NLLLoss
    from rlcore.policy import Policy
    from rlcore.testing.oracle import load_hf_model, state_copy

    root = tmp_path_factory.mktemp(f"sp-moe-{ep}")
    data = batch(tiny_tokenizer)
    megatron = {**SP, "expert_model_parallel_size": ep}
    config = policy_config(moe_model(), 2, lr=LR, megatron=megatron)
    policy = Policy(pool(2), config, tiny_tokenizer, name_prefix=f"sp-moe-ep{ep}", init_reference_model=False)
    try:
        result = policy.train(data, NLLLoss())
        policy.save_checkpoint(str(root / "weights"))
    finally:
        policy.shutdown()
    run = {
        "loss": float(result["loss"][0]),
        "aux": float(sum(result["all_mb_metrics"]["moe_aux_loss"])),
        "grad_norm": float(result["grad_norm"][0]),
        "weights": state_copy(load_hf_model(str(root / "weights"))),
    }
    assert parity_problems(run, float64_reference(moe_model(), data)) == []


def single_process_problems(
    pool: Any, tokenizer: Any, root: Any, model: str, world: int, megatron: dict, name: str
) -> list[str]:
    """Where a ``world``-rank policy under ``megatron`` (make_sequence_length_divisible_by 1) differs from the
    single-process reference: its logprobs, and one NLL step's loss, gradient norm and updated weights."""
    from rlcore.algorithms.loss_functions import NLLLoss
    from rlcore.policy import Policy

    data = batch(tokenizer)
    config = policy_config(model, world, megatron=megatron)
    policy = Policy(pool(world), config, tokenizer, name_prefix=name, init_reference_model=False)
    try:
        logprobs = policy.get_logprobs(data)["logprobs"]
        result = policy.train(data, NLLLoss())
        policy.save_checkpoint(str(root / "weights"))
    finally:
        policy.shutdown()
    problems = []
    if (diff := max_valid_diff(logprobs, hf_logprobs(model, data), data["input_lengths"])) > ATOL:
        problems.append(f"logprobs: max difference {diff} (atol {ATOL})")
    initial, (expected,) = single_process_sgd(model, [(data, NLLLoss())], SGD_LR)
    for what, got, want in (
        ("loss", result["loss"][0], expected.loss),
        ("grad_norm", result["grad_norm"][0], expected.grad_norm),
    ):
        if not abs(float(got) - want) <= ATOL * abs(want):
            problems.append(f"{what}: {float(got)!r} vs reference {want!r} (rtol {ATOL})")
    return problems + weight_problems(state_of(str(root / "weights")), expected.weights, initial, ATOL)


@pytest.mark.slow  # a second policy start
def test_untied_llama_step_matches_single_process_sgd(
    pool: Any, tiny_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Llama with untied embeddings (the output layer's own all-gather of the sequence) on the production worker:
    logprobs and one step equal the single-process reference."""
    root = tmp_path_factory.mktemp("sp-llama")
    assert single_process_problems(pool, tiny_tokenizer, root, model_dir("llama"), 2, SP, "sp-llama") == []


@pytest.mark.slow  # four ranks
def test_tensor_and_pipeline_parallel_step_matches_single_process_sgd(
    pool: Any, tiny_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """TP 2 + sequence parallelism + PP 2 (the pipeline sends sequence-sharded activations between stages) on
    four ranks: logprobs and one step equal the single-process reference."""
    root = tmp_path_factory.mktemp("sp-pp")
    megatron = {**SP, "pipeline_model_parallel_size": 2}
    model = model_dir("qwen3", tied=True)
    assert single_process_problems(pool, tiny_tokenizer, root, model, 4, megatron, "sp-pp") == []
