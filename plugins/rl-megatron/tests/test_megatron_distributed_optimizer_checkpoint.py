"""The distributed optimizer's checkpoint of a model whose optimizer groups mix float32 and bf16 parameters.

A bf16 Qwen2 on megatron's local spec holds its RMSNorm weights in float32 (torch's norm) and everything else in
bf16; with weight decay, its no-decay group holds both (the bf16 qkv biases beside the float32 norms). megatron-core
0.16.1 numbered such a group's parameters in another order than it stores them, so saving the distributed
optimizer's state at dp 2 failed in ``get_parameter_state_dp_zero`` (a size mismatch, NeMo-RL's PPO and GRPO
megatron recipes on Qwen2); ``rl_megatron.optimizer.repair_group_index_map`` renumbers them.

Two data-parallel ranks, bf16 with float32 main weights, the distributed optimizer (Adam with weight decay, lr
warm-up, clipping): a policy trains two steps, saving model and optimizer after the first. Restored from that
checkpoint, the second step is bit-identical to the uninterrupted one (loss, gradient norm, every weight), which
a parameter given another's Adam moments would not be; given only the weights (a fresh optimizer) the second step
differs, the control that makes the comparison meaningful.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from megatron_helpers import batch, model_dir, policy_config, state_of

from rlcore.testing.conformance import weight_problems

pytest_plugins = ["rlcore.testing.pytest_plugin"]
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

DISTRIBUTED_ADAM = {
    "optimizer": {
        "optimizer": "adam",
        "weight_decay": 0.1,
        "bf16": True,
        "params_dtype": "float32",
        "use_distributed_optimizer": True,
    },
    "scheduler": {"start_weight_decay": 0.1, "end_weight_decay": 0.1, "lr_warmup_iters": 1, "lr_warmup_init": 1e-3},
}


def _config(path: str) -> Any:
    return policy_config(path, 2, lr=1e-2, max_grad_norm=1.0, precision="bfloat16", megatron=DISTRIBUTED_ADAM)


@pytest.fixture(scope="module")
def runs(ray_session: None, tiny_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from rlcore.algorithms.loss_functions import NLLLoss
    from rlcore.policy import Policy
    from rlcore.testing.pytest_plugin import ClusterPool

    path = model_dir("qwen2")  # qkv biases: bf16 parameters in the no-decay group beside the float32 norms
    root = tmp_path_factory.mktemp("distopt")
    first, second = batch(tiny_tokenizer, seed=41), batch(tiny_tokenizer, seed=42)
    clusters = ClusterPool()
    out: dict[str, Any] = {}
    try:
        straight = Policy(
            clusters(2), _config(path), tiny_tokenizer, name_prefix="distopt-straight", init_reference_model=False
        )
        straight.train(first, NLLLoss())
        straight.save_checkpoint(str(root / "w1"), str(root / "o1"))
        out["step2"] = straight.train(second, NLLLoss())
        straight.save_checkpoint(str(root / "w2"))
        straight.shutdown()

        for name, optimizer_path in (("resumed", str(root / "o1")), ("fresh", None)):
            policy = Policy(
                clusters(2),
                _config(path),
                tiny_tokenizer,
                name_prefix=f"distopt-{name}",
                weights_path=str(root / "w1"),
                optimizer_path=optimizer_path,
                init_reference_model=False,
            )
            out[f"{name}_step2"] = policy.train(second, NLLLoss())
            policy.save_checkpoint(str(root / f"w2-{name}"))
            policy.shutdown()
    finally:
        clusters.shutdown()
    out.update({name: state_of(str(root / name)) for name in ("w1", "w2", "w2-resumed", "w2-fresh")})
    return out


def test_the_distributed_optimizer_resumes_bit_exactly(runs: dict[str, Any]) -> None:
    assert runs["resumed_step2"]["loss"].tolist() == runs["step2"]["loss"].tolist()
    assert runs["resumed_step2"]["grad_norm"].tolist() == runs["step2"]["grad_norm"].tolist()
    for name, tensor in runs["w2"].items():
        assert torch.equal(runs["w2-resumed"][name], tensor), name


def test_without_the_optimizer_state_the_step_differs(runs: dict[str, Any]) -> None:
    changed = [name for name, t in runs["w2"].items() if not torch.equal(t, runs["w1"][name])]
    assert changed, "the second step changed no weight: the comparison would be vacuous"
    problems = weight_problems(runs["w2-fresh"], runs["w2"], runs["w1"], 1e-2, "fresh optimizer vs resumed")
    assert problems, "a fresh optimizer gave the same step: the resume comparison would be vacuous"
