"""The critic's clipped value loss (rlcore.algorithms.ppo.value_loss.ValueLossFn) against a float64 recomputation
in plain Python loops over the valid tokens; a batch cut into micro-batches sums to the whole batch's loss,
gradient and metrics (global normalisation)."""

from __future__ import annotations

import math

import pytest
import torch

from rlcore.algorithms.ppo.config import ValueLossConfig
from rlcore.algorithms.ppo.value_loss import ValueLossFn, explained_variance
from rlcore.interfaces.loss import LossFunction, step_metrics

B, S = 5, 9


def batch(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    token_mask = torch.zeros(B, S)
    for b, (start, end) in enumerate([(2, 9), (3, 6), (1, 4), (4, 9), (2, 7)]):
        token_mask[b, start:end] = 1.0
    token_mask[3, 6] = 0.0  # a multi-turn hole
    return {
        "token_mask": token_mask,
        "sample_mask": torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0]),  # row 2 is filtered out
        "returns": torch.randn(B, S, generator=g),
        "values": torch.randn(B, S, generator=g) * 0.5,  # the critic's values at scoring (old values)
        "current": torch.randn(B, S, generator=g) * 0.5 + 0.2,
    }


def valid_positions(data: dict[str, torch.Tensor]) -> list[tuple[int, int]]:
    return [
        (b, i)
        for b in range(data["token_mask"].shape[0])
        for i in range(1, S)
        if data["token_mask"][b, i] and data["sample_mask"][b]
    ]


def reference(data, current: torch.Tensor, scale: float, cliprange: float | None) -> dict[str, float]:
    """Loss and metrics over all valid tokens, one token at a time."""
    tokens = valid_positions(data)
    n = len(tokens)
    loss = clipped = 0.0
    v_sum = r_sum = r_sq = res_sq = 0.0
    for b, i in tokens:
        v, r, old = float(current[b, i]), float(data["returns"][b, i]), float(data["values"][b, i])
        err = (v - r) ** 2
        if cliprange is not None:
            v_clipped = min(max(v, old - cliprange), old + cliprange)
            err_clipped = (v_clipped - r) ** 2
            clipped += err_clipped > err
            err = max(err, err_clipped)
        loss += 0.5 * scale * err
        v_sum, r_sum, r_sq, res_sq = v_sum + v, r_sum + r, r_sq + r * r, res_sq + (r - v) ** 2
    return {
        "loss": loss / n,
        "vf_clipfrac": clipped / n,
        "values_mean": v_sum / n,
        "returns_mean": r_sum / n,
        "returns_sq_mean": r_sq / n,
        "residual_sq_mean": res_sq / n,
        "values_min": min(float(current[b, i]) for b, i in tokens),
        "values_max": max(float(current[b, i]) for b, i in tokens),
        "num_valid_tokens": n,
        "num_valid_samples": len({b for b, _ in tokens}),
    }


def counts(data) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = valid_positions(data)
    return torch.tensor(len({b for b, _ in tokens})), torch.tensor(len(tokens))


@pytest.mark.parametrize("scale,cliprange", [(1.0, None), (0.4, None), (1.0, 0.2), (0.4, 0.05)])
def test_value_loss_scale_and_cliprange_against_float64(scale, cliprange):
    data = batch()
    fn = ValueLossFn(ValueLossConfig(scale=scale, cliprange=cliprange))
    assert isinstance(fn, LossFunction)
    current = data["current"].clone().requires_grad_(True)
    loss, metrics = fn(current, data, *counts(data))
    expected = reference(data, data["current"], scale, cliprange)
    for name, value in expected.items():
        assert float(metrics[name]) == pytest.approx(value, abs=1e-6), name
    assert loss.item() == pytest.approx(expected["loss"], abs=1e-6)
    if cliprange is not None and cliprange < 0.1:
        assert 0 < expected["vf_clipfrac"] < 1  # the clip binds on some tokens and not on others
    loss.backward()
    assert current.grad is not None
    # d loss / d V: scale * (V - R) / n where the kept error moves with V; 0 where the clip binds, and off the mask
    n = expected["num_valid_tokens"]
    grad = torch.zeros(B, S, dtype=torch.float64)
    for b, i in valid_positions(data):
        v, r, old = float(data["current"][b, i]), float(data["returns"][b, i]), float(data["values"][b, i])
        if cliprange is None:
            grad[b, i] = scale * (v - r) / n
            continue
        v_clipped = min(max(v, old - cliprange), old + cliprange)
        if (v_clipped - r) ** 2 > (v - r) ** 2:
            grad[b, i] = scale * (v_clipped - r) / n if v_clipped == v else 0.0
        else:
            grad[b, i] = scale * (v - r) / n
    assert torch.allclose(current.grad.double(), grad, atol=1e-7)


def test_micro_batches_sum_to_the_whole_batch():
    data = batch(1)
    fn = ValueLossFn(ValueLossConfig(scale=0.4, cliprange=0.1))
    seqs, toks = counts(data)
    whole_values = data["current"].clone().requires_grad_(True)
    whole_loss, whole_metrics = fn(whole_values, data, seqs, toks)
    whole_loss.backward()
    per_micro_batch: dict[str, list[float]] = {}
    grads = []
    for rows in (slice(0, 2), slice(2, 3), slice(3, 5)):  # uneven: 2 rows, a filtered row alone, 2 rows
        part = {k: v[rows] for k, v in data.items()}
        values = part["current"].clone().requires_grad_(True)
        loss, metrics = fn(values, part, seqs, toks)
        loss.backward()
        grads.append(values.grad)
        per_micro_batch.setdefault("loss_tensor", []).append(loss.item())
        for name, value in metrics.items():
            per_micro_batch.setdefault(name, []).append(float(value))
    summed = step_metrics(per_micro_batch, steps=1)
    assert summed.pop("loss_tensor") == pytest.approx(whole_loss.item(), abs=1e-7)
    for name, value in whole_metrics.items():
        assert summed[name] == pytest.approx(float(value), abs=1e-7), name
    assert per_micro_batch["values_min"][1] == math.inf  # the filtered row has no valid token
    assert torch.allclose(torch.cat(grads), whole_values.grad, atol=1e-8)


def test_explained_variance_from_the_summed_moments():
    data = batch(2)
    seqs, toks = counts(data)
    _, metrics = ValueLossFn(ValueLossConfig())(data["current"], data, seqs, toks)
    got = explained_variance({k: float(v) for k, v in metrics.items()})
    tokens = valid_positions(data)
    returns = [float(data["returns"][b, i]) for b, i in tokens]
    residuals = [float(data["returns"][b, i] - data["current"][b, i]) for b, i in tokens]

    def population_variance(xs: list[float]) -> float:
        mean = sum(xs) / len(xs)
        return sum((x - mean) ** 2 for x in xs) / len(xs)

    assert got == pytest.approx(1 - population_variance(residuals) / population_variance(returns), abs=1e-6)
    perfect = dict(data, current=data["returns"].clone())
    _, metrics = ValueLossFn(ValueLossConfig())(perfect["current"], perfect, seqs, toks)
    assert explained_variance({k: float(v) for k, v in metrics.items()}) == pytest.approx(1.0, abs=1e-6)


def test_padding_is_never_read_and_missing_inputs_are_named():
    data = batch(3)
    seqs, toks = counts(data)
    fn = ValueLossFn(ValueLossConfig(cliprange=0.2))
    off = (data["token_mask"] * data["sample_mask"][:, None]) == 0
    noisy = dict(
        data, returns=data["returns"].masked_fill(off, math.nan), values=data["values"].masked_fill(off, math.inf)
    )
    current = data["current"].masked_fill(off, math.nan).requires_grad_(True)
    loss, _ = fn(current, noisy, seqs, toks)
    loss.backward()
    assert loss.item() == pytest.approx(reference(data, data["current"], 1.0, 0.2)["loss"], abs=1e-6)
    assert current.grad is not None and torch.isfinite(current.grad).all() and not current.grad[off].any()
    with pytest.raises(KeyError, match="'returns'"):
        fn(data["current"], {k: v for k, v in data.items() if k != "returns"}, seqs, toks)
    with pytest.raises(KeyError, match="cliprange"):
        fn(data["current"], {k: v for k, v in data.items() if k != "values"}, seqs, toks)
