"""The router load-balancing loss (rlcore.training.moe_aux) and how the step loop normalises it.

``load_balancing_loss`` is compared with transformers' own ``load_balancing_loss_func`` (the definition the
rule adopts); the loop's arithmetic with a hand recomputation over fake step hooks (an orchestration test:
no model is needed to check where the term goes and how it is weighted)."""

from __future__ import annotations

import pytest
import torch

from rlcore.data import BatchedDataDict
from rlcore.training.loop import StepHooks, train_steps
from rlcore.training.moe_aux import AuxLoss, aux_coefficient, load_balancing_loss


def test_load_balancing_loss_is_hugging_face_s_over_the_real_tokens():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    gen = torch.Generator().manual_seed(3)
    batch, width, experts, top_k = 3, 7, 8, 2
    layers = tuple(torch.randn(batch * width, experts, generator=gen) for _ in range(2))
    mask = torch.arange(width)[None, :] < torch.tensor([7, 4, 2])[:, None]
    expected = load_balancing_loss_func(layers, experts, top_k, mask.long())
    got = load_balancing_loss(list(layers), mask, top_k)
    assert abs(float(got) - float(expected)) <= 1e-6 * float(expected)
    # Padding rows do not count: the same as the real tokens alone.
    alone = load_balancing_loss([layer[mask.reshape(-1)] for layer in layers], torch.ones(13, dtype=torch.bool), top_k)
    assert abs(float(alone) - float(got)) <= 1e-6 * float(got)


def test_no_routed_token_adds_nothing_and_keeps_the_graph():
    logits = torch.randn(4, 8, requires_grad=True)
    loss = load_balancing_loss([logits], torch.zeros(4, dtype=torch.bool), 2)
    loss.backward()
    assert float(loss.detach()) == 0.0 and float(logits.grad.abs().sum()) == 0.0


def test_the_coefficient_follows_the_config():
    from types import SimpleNamespace

    assert aux_coefficient(SimpleNamespace(output_router_logits=False, router_aux_loss_coef=0.1)) == 0.0
    assert aux_coefficient(SimpleNamespace(output_router_logits=True, router_aux_loss_coef=0.1)) == 0.1
    assert aux_coefficient(SimpleNamespace()) == 0.0  # a dense model


def _nll(logprobs, data, global_seqs, global_toks):
    mask = data["token_mask"][:, 1:] * data["sample_mask"][:, None]
    loss = -(logprobs[:, 1:] * mask).sum() / global_toks
    return loss, {"loss": loss.detach()}


@pytest.mark.parametrize("mbs", [1, 2])
def test_the_loop_adds_each_micro_batch_s_aux_weighted_by_its_routed_tokens(mbs):
    """loss = NLL + coef * sum_mb aux_mb * n_mb / N, N the step's routed tokens (sample_mask 0 rows excluded);
    the moe_aux_loss metrics sum to the step's aux; its gradient reaches the parameter."""
    weight = torch.tensor(0.3, requires_grad=True)
    lengths = torch.tensor([5, 3, 4, 6])
    data = BatchedDataDict(
        input_ids=torch.ones(4, 6, dtype=torch.long),
        input_lengths=lengths,
        token_mask=(torch.arange(6)[None, :] < lengths[:, None]).float(),
        sample_mask=torch.tensor([1.0, 0.0, 1.0, 1.0]),
    )
    seen: list[AuxLoss] = []

    def forward(mb):
        routed = float((mb["input_lengths"] * mb["sample_mask"]).sum())
        seen.append(AuxLoss(weight * (1 + len(seen)), routed, 0.25))  # a different value per micro-batch
        return torch.zeros(mb["input_ids"].shape) + weight * 0 - 1.0

    steps = []
    hooks = StepHooks(
        forward=forward,
        all_reduce_sum=lambda t: None,
        finish_grads=lambda: None,
        clip_grads=lambda max_norm: float(weight.grad),
        optimizer_step=lambda: steps.append(float(weight.grad)),
        zero_grad=lambda: None,
        model_aux_loss=lambda: seen[-1],
    )
    out = train_steps(data, _nll, hooks, local_batch_size=4, mbs=mbs, max_grad_norm=None)
    routed_total = 5 + 4 + 6
    expected_aux = sum(float(a.value.detach()) * a.tokens / routed_total for a in seen)
    nll = (4 + 3 + 5) / (4 + 3 + 5)  # every valid token has logprob -1
    assert out["losses"][0] == pytest.approx(nll + 0.25 * expected_aux, rel=1e-6)
    assert sum(out["all_mb_metrics"]["moe_aux_loss"]) == pytest.approx(expected_aux, rel=1e-6)
    grad = sum(0.25 * (i + 1) * a.tokens / routed_total for i, a in enumerate(seen))
    assert steps == [pytest.approx(grad, rel=1e-6)]
