"""Value models on megatron (``Policy(..., model_head="value")``, capability ``value_head``): PPO's critic.

Each layout is one module-scoped 2-rank policy (real Ray workers, gloo, CPU) started from a *causal-LM*
checkpoint, so its head is initialised fresh. In one run it gives its values, saves the initial weights, trains one
SGD step (momentum 0.9: the first step is plain SGD's) of the kit's squared-error value loss (normalised by
``global_valid_toks``), saves again, trains two more steps and saves the final weights. The reference is the value
kit's float64 Hugging Face ``AutoModelForTokenClassification`` (one label) in this process, its values aligned by
the kit's ``hf_values`` (position ``i`` holds the head at position ``i - 1``; position 0 and padding 0),
independent of rlcore.training:

- the initial values equal the reference's forward of the saved initial weights, and the saved head is exactly the
  one Hugging Face initialises for the class under rlcore's seed (``load_value_model`` of the causal LM);
- the first step's loss, gradient norm and updated weights equal a float64 SGD step of the reference;
- the loss falls (by a tenth over three steps), and the final values equal the reference's forward of the final
  checkpoint, which ``AutoModelForTokenClassification.from_pretrained`` loads cleanly with ``num_labels == 1``.

Layouts: ``tp2-sp`` (Qwen2 with tied embeddings, TP 2 with sequence parallelism, odd lengths padded by the
worker), ``dp2`` (Llama, two data-parallel ranks of two micro-batches each), ``pp2`` (Qwen2 with tied embeddings,
3 layers split 2 + 1 over 2 pipeline stages: only the last has the head) and ``cp2`` (Llama, context parallel 2:
the head scores each rank's positions, gathered like logits). The tp2-sp and pp2 runs are then resumed on one
rank (resharded). Token-distribution methods are refused on the workers in one line.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from megatron_helpers import batch, call_workers, max_valid_diff, model_dir, policy_config

from rlcore.testing.conformance import weight_problems
from rlcore.testing.conformance.value_model import (
    SquaredErrorValueLoss,
    hf_values,
    load_value_checkpoint,
    value_sgd_step,
    weights_of,
    with_returns,
)

pytest_plugins = ["rlcore.testing.pytest_plugin"]
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

ATOL = 1e-5
LR = 0.02
#: SGD momentum: optimizer state the resumed runs must restore (the first step is plain SGD's, as the reference's).
MOMENTUM = {"optimizer": {"sgd_momentum": 0.9}}
LAYOUTS: dict[str, dict[str, Any]] = {
    "tp2-sp": dict(
        arch="qwen2",
        tied=True,
        layers=2,
        megatron={"tensor_model_parallel_size": 2, "sequence_parallel": True},
        policy={"make_sequence_length_divisible_by": 1},
        resume=True,
    ),
    "dp2": dict(arch="llama", tied=False, layers=2, megatron={}),
    "pp2": dict(
        arch="qwen2",
        tied=True,
        layers=3,
        megatron={
            "pipeline_model_parallel_size": 2,
            "num_layers_in_first_pipeline_stage": 2,
            "num_layers_in_last_pipeline_stage": 1,
        },
        resume=True,
    ),
    "cp2": dict(arch="llama", tied=False, layers=2, megatron={"context_parallel_size": 2}),
}


def value_batch(tokenizer: Any) -> Any:
    return with_returns(batch(tokenizer), seed=7)


def hf_value_model(path: str) -> Any:
    """The kit's float64 ``AutoModelForTokenClassification`` of ``path``, also failing unless every weight was in
    the files and it has one label."""
    from transformers import AutoModelForTokenClassification

    _, info = AutoModelForTokenClassification.from_pretrained(path, output_loading_info=True)
    bad = {k: v for k, v in info.items() if v}
    assert not bad, f"{path} does not load cleanly as a token-classification model: {bad}"
    model = load_value_checkpoint(path)
    assert model.config.num_labels == 1 and model.score.weight.shape[0] == 1
    return model


def reference_step(path: str, data: Any, lr: float) -> dict[str, Any]:
    """One float64 SGD step of the kit's squared-error loss over the whole batch, with its gradient norm."""
    model = hf_value_model(path).train()
    initial = weights_of(model)
    loss = value_sgd_step(model, data, SquaredErrorValueLoss(), lr)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = math.sqrt(sum(float(g.square().sum()) for g in grads))
    return {"loss": loss, "grad_norm": norm, "initial": initial, "weights": weights_of(model)}


# --------------------------------------------------------------------------- the run


@pytest.fixture(scope="module")
def pool(ray_session: None) -> Any:
    from rlcore.testing.pytest_plugin import ClusterPool

    clusters = ClusterPool()
    yield clusters
    clusters.shutdown()


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def run(request: pytest.FixtureRequest, pool: Any, tiny_tokenizer: Any, tmp_path_factory: Any) -> dict[str, Any]:
    from rlcore.policy import Policy

    spec = LAYOUTS[request.param]
    path = model_dir(spec["arch"], spec["tied"], spec["layers"])
    data = value_batch(tiny_tokenizer)
    root = tmp_path_factory.mktemp(f"value-{request.param}")
    config = policy_config(path, 2, lr=LR, megatron={**spec["megatron"], **MOMENTUM}, **spec.get("policy", {}))
    policy = Policy(pool(2), config, tiny_tokenizer, name_prefix=f"value-{request.param}", model_head="value")
    try:
        out: dict[str, Any] = {"name": request.param, "model": path, "batch": data, "root": root}
        out["values"] = policy.get_values(data)["values"]
        policy.save_checkpoint(str(root / "initial"))
        out["first"] = policy.train(data, SquaredErrorValueLoss())
        policy.save_checkpoint(str(root / "first"))
        out["later"] = [float(policy.train(data, SquaredErrorValueLoss())["loss"][0]) for _ in range(2)]
        out["final_values"] = policy.get_values(data)["values"]
        policy.save_checkpoint(str(root / "final"), str(root / "final-megatron"))
        out["next"] = policy.train(data, SquaredErrorValueLoss())
        policy.save_checkpoint(str(root / "next"))
        out["refusals"] = {
            method: _refusal(policy, method, *args)
            for method, args in (("get_logprobs", (data,)), ("get_topk_logits", (data, 2)), ("prepare_refit_info", ()))
        }
    finally:
        policy.shutdown()
    if spec.get("resume"):
        out["resumed"] = resume_on_one_rank(pool, tiny_tokenizer, path, root, data, spec.get("policy", {}))
    return out


def resume_on_one_rank(
    pool: Any, tokenizer: Any, path: str, root: Any, data: Any, overrides: dict[str, Any]
) -> dict[str, Any]:
    """A 1-rank value policy given the *initial* HF weights and the *final* megatron distributed checkpoint
    (resharded from the layout's 2 ranks, which must win, head and momentum included): its values and the step
    after the checkpoint (saved); then the HF token-classification checkpoint of the first step loaded alone
    (``load_checkpoint``: its head must load, not be initialised) and the values it gives."""
    from rlcore.policy import Policy

    policy = Policy(
        pool(1),
        policy_config(path, 1, lr=LR, megatron=MOMENTUM, **overrides),
        tokenizer,
        name_prefix="value-resumed",
        weights_path=str(root / "initial"),
        optimizer_path=str(root / "final-megatron"),
        model_head="value",
    )
    try:
        out = {"values": policy.get_values(data)["values"], "next": policy.train(data, SquaredErrorValueLoss())}
        policy.save_checkpoint(str(root / "resumed-next"))
        call_workers(policy, "load_checkpoint", str(root / "first"))
        out["first_values"] = policy.get_values(data)["values"]
        return out
    finally:
        policy.shutdown()


def _refusal(policy: Any, method: str, *args: Any) -> str:
    """The error a worker raises for ``method`` (the ``Policy`` facade refuses these on the driver first)."""
    try:
        call_workers(policy, method, *args)
    except Exception as exc:  # noqa: BLE001  # Ray wraps the worker's error
        return str(exc)
    return ""


def test_values_match_hf_token_classification(run: dict) -> None:
    data, got = run["batch"], run["values"]
    expected = hf_values(hf_value_model(str(run["root"] / "initial")), data).detach()
    assert got.dtype == torch.float32 and got.shape == expected.shape
    assert max_valid_diff(got.double(), expected, data["input_lengths"]) <= ATOL
    positions = torch.arange(got.shape[1])[None, :]
    assert (got[:, 0] == 0).all() and (got[positions >= data["input_lengths"][:, None]] == 0).all()
    assert float(got[:, 1:].abs().max()) > 1e-3  # not vacuously zero


def test_fresh_head_is_hugging_faces_initialisation(run: dict) -> None:
    """Loaded from a causal LM, the head is what Hugging Face initialises for the class under rlcore's seed, and
    every other weight is the checkpoint's (``lm_head`` dropped)."""
    from transformers import AutoConfig

    from rlcore.training.value_head import load_value_model, value_model_config

    hf = load_value_model(run["model"], value_model_config(AutoConfig.from_pretrained(run["model"]))).state_dict()
    saved = hf_value_model(str(run["root"] / "initial")).state_dict()
    assert sorted(saved) == sorted(hf)
    assert float(saved["score.bias"].abs().max()) == 0.0 and float(saved["score.weight"].std()) > 0
    for name, tensor in hf.items():
        assert torch.equal(saved[name].float(), tensor.float()), name


def test_one_step_matches_float64_reference(run: dict) -> None:
    expected = reference_step(str(run["root"] / "initial"), run["batch"], LR)
    loss, norm = float(run["first"]["loss"][0]), float(run["first"]["grad_norm"][0])
    assert abs(loss - expected["loss"]) <= ATOL * expected["loss"], (loss, expected["loss"])
    assert abs(norm - expected["grad_norm"]) <= ATOL * expected["grad_norm"], (norm, expected["grad_norm"])
    saved = hf_value_model(str(run["root"] / "first")).state_dict()
    problems = weight_problems(saved, expected["weights"], expected["initial"], ATOL)
    assert not problems, "\n".join(problems)


def test_training_lowers_the_loss_and_checkpoint_reloads(run: dict) -> None:
    losses = [float(run["first"]["loss"][0]), *run["later"]]
    assert losses[-1] < 0.9 * losses[0], losses  # as the value kit asks, with a margin
    data = run["batch"]
    expected = hf_values(hf_value_model(str(run["root"] / "final")), data).detach()
    assert max_valid_diff(run["final_values"].double(), expected, data["input_lengths"]) <= ATOL
    assert not torch.equal(run["final_values"], run["values"])


def test_resumed_on_one_rank_continues_the_run(run: dict) -> None:
    """Resharded to one rank, the value model gives the same values and the same next step (loss, gradient norm
    and the weights it leaves: the momentum was restored) as the run it was saved from; a token-classification
    checkpoint loaded alone gives its own values."""
    if "resumed" not in run:
        pytest.skip("resumed from the tp2-sp and pp2 runs only (a 1-rank start each)")
    resumed, lengths = run["resumed"], run["batch"]["input_lengths"]
    assert max_valid_diff(resumed["values"], run["final_values"], lengths) <= ATOL
    for key in ("loss", "grad_norm"):
        got, expected = float(resumed["next"][key][0]), float(run["next"][key][0])
        assert abs(got - expected) <= ATOL * abs(expected), (key, got, expected)
    root = run["root"]
    before = weights_of(hf_value_model(str(root / "final")))
    after, expected_after = (weights_of(hf_value_model(str(root / name))) for name in ("resumed-next", "next"))
    problems = weight_problems(after, expected_after, before, ATOL, what="the step after resuming (momentum)")
    assert not problems, "\n".join(problems)
    first = hf_values(hf_value_model(str(run["root"] / "first")), run["batch"]).detach()
    assert max_valid_diff(resumed["first_values"].double(), first, lengths) <= ATOL


def test_token_distribution_methods_are_refused(run: dict) -> None:
    for method, error in run["refusals"].items():
        assert "a value model has no token distribution" in error, (method, error)
