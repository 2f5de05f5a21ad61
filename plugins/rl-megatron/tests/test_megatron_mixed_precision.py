"""bf16 with fp32 main weights and the distributed optimizer, on CPU (megatron-core's own optimizers, cpu_compat).

Three 2-rank (dp 2) policies of a tiny Llama, Adam with weight decay and clipping:

- ``distributed``: bf16 + the distributed optimizer, two steps, a checkpoint after the first;
- ``plain``: bf16 + the plain mixed-precision optimizer, the same two steps: the distributed optimizer gives the
  same steps (losses and gradient norms to 1e-6, bf16 weights equal but for a last-bit rounding in < 0.1%);
- ``resumed``: the distributed optimizer restored from the first step's checkpoint: its second step is
  bit-identical to the uninterrupted one (megatron-core's torch-Adam fallback needed three repairs,
  rl_megatron.optimizer; with one step tensor shared by all parameters the second step differed).

bf16 is checked against a float64 single-process reference of the first step, from the same bf16-rounded weights:
logprobs within 0.05 (bf16's 8-bit mantissa, 2^-8 relative per rounding, through two layers), loss within 1% and
gradient norm within 3%; and bf16 really ran (not float32 silently): the gradient norm is off by more than 1e-5
relative, where float32 is ~1e-7 off.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from megatron_helpers import batch, call_workers, max_valid_diff, model_dir, policy_config, state_of

pytest_plugins = ["rlcore.testing.pytest_plugin"]
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.slow]  # ~4 min: three 2-rank policies

ADAM = {"optimizer": "adam", "weight_decay": 0.01, "bf16": True, "params_dtype": "float32"}
LR = 1e-2


def _config(path: str, distributed: bool) -> Any:
    return policy_config(
        path,
        2,
        lr=LR,
        max_grad_norm=1.0,
        precision="bfloat16",
        megatron={
            "optimizer": {**ADAM, "use_distributed_optimizer": distributed},
            "scheduler": {"start_weight_decay": 0.01, "end_weight_decay": 0.01},
        },
    )


@pytest.fixture(scope="module")
def runs(ray_session: None, tiny_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> dict:
    from rlcore.algorithms.loss_functions import NLLLoss
    from rlcore.policy import Policy
    from rlcore.testing.pytest_plugin import ClusterPool

    path = model_dir("llama")
    root = tmp_path_factory.mktemp("bf16")
    first, second = batch(tiny_tokenizer, seed=31), batch(tiny_tokenizer, seed=32)
    clusters = ClusterPool()
    out: dict[str, Any] = {"model": path, "first": first}
    try:
        for name, distributed in (("distributed", True), ("plain", False)):
            policy = Policy(clusters(2), _config(path, distributed), tiny_tokenizer, name_prefix=f"bf16-{name}")
            out[f"{name}_logprobs"] = policy.get_logprobs(first)["logprobs"]
            out[f"{name}_summary"] = call_workers(policy, "optimizer_state_summary")
            out[f"{name}_step1"] = policy.train(first, NLLLoss())
            if distributed:
                policy.save_checkpoint(str(root / "w1"), str(root / "o1"))
            out[f"{name}_step2"] = policy.train(second, NLLLoss())
            policy.save_checkpoint(str(root / f"{name}-w2"))
            policy.shutdown()
        resumed = Policy(
            clusters(2),
            _config(path, True),
            tiny_tokenizer,
            name_prefix="bf16-resumed",
            weights_path=str(root / "w1"),
            optimizer_path=str(root / "o1"),
            init_reference_model=False,
        )
        out["resumed_step2"] = resumed.train(second, NLLLoss())
        resumed.save_checkpoint(str(root / "resumed-w2"))
        resumed.shutdown()
    finally:
        clusters.shutdown()
    out.update({name: state_of(str(root / name)) for name in ("w1", "distributed-w2", "plain-w2", "resumed-w2")})
    out["saved_dtypes"] = _saved_dtypes(str(root / "w1"))
    return out


def _saved_dtypes(weights: str) -> set[torch.dtype]:
    from pathlib import Path

    from safetensors import safe_open

    dtypes = set()
    for file in Path(weights).glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            dtypes |= {f.get_slice(k).get_dtype() for k in f.keys()}
    return {getattr(torch, {"BF16": "bfloat16", "F32": "float32"}.get(d, d)) for d in dtypes}


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float) -> bool:
    return bool(((a.double() - b.double()).abs() <= rtol * b.double().abs()).all())


def test_the_model_is_bf16_and_its_main_weights_fp32_sharded_over_dp(runs: dict) -> None:
    assert runs["saved_dtypes"] == {torch.bfloat16}
    total = sum(t.numel() for t in runs["w1"].values())
    plain, distributed = runs["plain_summary"], runs["distributed_summary"]
    assert [s["numel"] for s in plain] == [total, total] and plain[0]["dtypes"] == ["torch.float32"]
    # each dp rank holds the main weights (and Adam moments) of its slice only
    assert sum(s["numel"] for s in distributed) == total and all(s["numel"] < total for s in distributed)
    assert all(s["dtypes"] == ["torch.float32"] for s in distributed)


def test_the_distributed_optimizer_takes_the_plain_optimizers_steps(runs: dict) -> None:
    for step in ("step1", "step2"):
        assert _close(runs[f"distributed_{step}"]["loss"], runs[f"plain_{step}"]["loss"], 1e-6), step
        assert _close(runs[f"distributed_{step}"]["grad_norm"], runs[f"plain_{step}"]["grad_norm"], 1e-6), step
    changed = [name for name, t in runs["plain-w2"].items() if not torch.equal(t, runs["w1"][name])]
    assert changed, "the second step changed no weight: the comparison would be vacuous"
    # Clipping scales by the gradient norm, which the two sum in another order (float32 round-off, ~1e-7): a bf16
    # weight near a rounding boundary may round the other way. So: equal up to one bf16 step in < 0.1% of them.
    flipped = total = 0
    for name, tensor in runs["plain-w2"].items():
        got = runs["distributed-w2"][name]
        one_step = tensor.abs() * 2.0**-7  # bf16 keeps 8 significant bits: neighbours are <= 2^-7 relative apart
        assert bool(((got - tensor).abs() <= one_step).all()), name
        flipped, total = flipped + int((got != tensor).sum()), total + tensor.numel()
    assert flipped <= 1e-3 * total, (flipped, total)


def test_the_distributed_optimizer_resumes_bit_exactly(runs: dict) -> None:
    assert runs["resumed_step2"]["loss"].tolist() == runs["distributed_step2"]["loss"].tolist()
    assert runs["resumed_step2"]["grad_norm"].tolist() == runs["distributed_step2"]["grad_norm"].tolist()
    for name, tensor in runs["distributed-w2"].items():
        assert torch.equal(runs["resumed-w2"][name], tensor), name


def test_bf16_is_within_bf16_tolerance_of_a_float64_reference(runs: dict) -> None:
    from rlcore.algorithms.loss_functions import NLLLoss
    from rlcore.testing.oracle import hf_token_logprobs, load_hf_model, oracle_gradients

    model = load_hf_model(runs["model"]).to(torch.bfloat16).to(torch.float64)  # megatron's starting weights
    data = runs["first"]
    with torch.no_grad():
        expected_logprobs = hf_token_logprobs(model, data).float()
    assert max_valid_diff(runs["distributed_logprobs"], expected_logprobs, data["input_lengths"]) <= 0.05
    loss, grads = oracle_gradients(model, data, NLLLoss())
    norm = math.sqrt(sum(float(g.square().sum()) for g in grads.values()))
    got_loss, got_norm = float(runs["distributed_step1"]["loss"][0]), float(runs["distributed_step1"]["grad_norm"][0])
    assert abs(got_loss - loss) <= 1e-2 * abs(loss), (got_loss, loss)
    assert abs(got_norm - norm) <= 3e-2 * norm, (got_norm, norm)
    assert abs(got_norm - norm) > 1e-5 * norm, "the gradient norm is float32-exact: did bf16 run at all?"
