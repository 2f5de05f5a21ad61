"""Sequence-level off-policy correction (``seq-tis``, ``geo-mask``) and the engine/trainer-gap metrics of GRPO's
loss, against float64 recomputations written out here token by token (no helper of the implementation).

The batch is multi-turn shaped: each sample has a prompt, a first generated turn, environment tokens
(``token_mask`` 0, holding logprobs far from the rest so that counting them would show) and a second generated
turn; padding holds NaN; one sample is masked out by ``sample_mask``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from rlcore.algorithms.grpo.loss import ClippedPGLossFn
from rlcore.algorithms.grpo.loss_config import ClippedPGLossConfig
from rlcore.algorithms.grpo.off_policy import PEARSON_NAME, probs_pearson
from rlcore.interfaces.loss import step_metrics

RTOL, ATOL = 1e-9, 1e-12
CLIP = 0.2
#: per-sample mean of log pi_prev - log pi_generation: below, inside and above both modes' bounds; 0.10, -0.11
#: and 0.09 are within 10% of geo-mask's log-bounds (0.0953, -0.1054), so a wrong token count shows
SEQ_OFFSETS = [-0.5, -0.02, 0.0, 0.10, 0.25, -0.11, 0.09, 0.6, -0.06, 0.01]
SEQ_TIS = dict(truncated_importance_sampling_type="seq-tis", truncated_importance_sampling_ratio_min=0.5)
SEQ_TIS_HIGH = 2.0
GEO_MASK = dict(truncated_importance_sampling_type="geo-mask", truncated_importance_sampling_ratio_min=0.9)
GEO_MASK_HIGH = 1.1


def multi_turn_batch(seed: int = 0, dtype: torch.dtype = torch.float64):
    """logprobs (a leaf), and data with token_mask / sample_mask / advantages / prev / generation logprobs."""
    rng = np.random.default_rng(seed)
    B, S = len(SEQ_OFFSETS), 16
    token_mask = np.zeros((B, S))
    env = np.zeros((B, S), dtype=bool)
    for b in range(B):
        prompt, turn1, env_len, turn2 = rng.integers(1, 3), rng.integers(2, 5), rng.integers(1, 3), rng.integers(2, 5)
        token_mask[b, prompt : prompt + turn1] = 1.0
        start2 = prompt + turn1 + env_len
        env[b, prompt + turn1 : start2] = True
        token_mask[b, start2 : start2 + turn2] = 1.0
    sample_mask = np.ones(B)
    sample_mask[2] = 0.0
    prev = np.log(rng.uniform(0.05, 0.5, (B, S)))
    logprobs = np.minimum(prev + rng.normal(0.0, 0.25, (B, S)), -1e-3)
    noise = rng.normal(0.0, 0.02, (B, S))
    counted = token_mask.astype(bool) & (np.arange(S) > 0)
    noise -= np.nanmean(np.where(counted, noise, np.nan), axis=1, keepdims=True)  # a sample's mean is its offset
    gen = prev - np.asarray(SEQ_OFFSETS)[:, None] + noise
    prev[env], gen[env] = -0.01, -9.0  # environment tokens: a huge gap, which must not count
    pad = (token_mask == 0) & ~env
    prev[pad], gen[pad] = np.nan, np.nan
    advantages = np.repeat(rng.normal(0.0, 1.0, (B, 1)), S, axis=1)

    def tensor(values: np.ndarray) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype)

    data = {
        "token_mask": tensor(token_mask),
        "sample_mask": tensor(sample_mask),
        "advantages": tensor(advantages),
        "prev_logprobs": tensor(prev),
        "generation_logprobs": tensor(gen),
    }
    return tensor(logprobs).requires_grad_(True), data


def valid_tokens(data) -> list[list[int]]:
    """Per sample, the positions that count (empty for a masked-out sample)."""
    tm, sm = data["token_mask"].numpy(), data["sample_mask"].numpy()
    return [[t for t in range(1, tm.shape[1]) if tm[b, t] and sm[b]] for b in range(tm.shape[0])]


def counts(data) -> tuple[torch.Tensor, torch.Tensor]:
    toks = valid_tokens(data)
    return torch.tensor(float(data["sample_mask"].sum())), torch.tensor(float(sum(map(len, toks))))


def sequence_weight(mode: str, log_w: list[float], low: float, high: float) -> tuple[float, bool]:
    """The float64 weight of a sequence with token log-weights ``log_w`` and whether it is out of bounds."""
    if mode == "seq-tis":
        raw = math.exp(math.fsum(log_w))
        return min(max(raw, low), high), not low <= raw <= high
    geo = math.exp(math.fsum(log_w) / len(log_w))
    inside = low <= geo <= high
    return (1.0 if inside else 0.0), not inside


def reference(mode: str | None, token_level: bool, logprobs, data, low: float = 0.0, high: float = 0.0):
    """PPO-clip loss with the mode's sequence weight, d loss / d logprobs, sampling_importance_ratio and
    is_oob_ratio, in float64 Python."""
    lp = logprobs.detach().double().numpy()
    adv, prev, gen = (data[k].double().numpy() for k in ("advantages", "prev_logprobs", "generation_logprobs"))
    toks = valid_tokens(data)
    n_seqs, n_toks = float(data["sample_mask"].sum()), float(sum(map(len, toks)))
    loss, grad = 0.0, np.zeros_like(lp)
    weights, out = [], []
    for b, ts in enumerate(toks):
        if not ts:
            continue
        log_w = [prev[b, t] - gen[b, t] for t in ts]
        w, oob = (1.0, False) if mode is None else sequence_weight(mode, log_w, low, high)
        weights.append(w)
        out.append(oob)
        scale = 1.0 / n_toks if token_level else 1.0 / (len(ts) * n_seqs)
        for t in ts:
            A, r = adv[b, t], math.exp(lp[b, t] - prev[b, t])
            unclipped, clipped = -A * r, -A * min(max(r, 1 - CLIP), 1 + CLIP)
            actor, d_actor = (unclipped, -A * r) if unclipped >= clipped else (clipped, 0.0)
            loss += scale * w * actor
            grad[b, t] += scale * w * d_actor
    return loss, grad, sum(weights) / n_seqs, sum(out) / n_seqs


def run_loss(cfg: dict, logprobs, data):
    gseqs, gtoks = counts(data)
    loss, metrics = ClippedPGLossFn(dict(use_importance_sampling_correction=True, **cfg))(logprobs, data, gseqs, gtoks)
    loss.backward()
    grad = logprobs.grad.detach().double().numpy().copy()
    logprobs.grad = None
    return loss.item(), grad, metrics


MODES = [(SEQ_TIS, SEQ_TIS_HIGH), (GEO_MASK, GEO_MASK_HIGH)]


@pytest.mark.parametrize("token_level", [True, False], ids=["tok", "seq"])
@pytest.mark.parametrize(("mode", "high"), MODES, ids=["seq-tis", "geo-mask"])
def test_sequence_modes_match_float64(mode, high, token_level):
    logprobs, data = multi_turn_batch()
    kind, low = mode["truncated_importance_sampling_type"], mode["truncated_importance_sampling_ratio_min"]
    # the data bind both bounds: some kept sequences, some below, some above
    prev, gen = data["prev_logprobs"].numpy(), data["generation_logprobs"].numpy()
    log_sums = [math.fsum(prev[b, t] - gen[b, t] for t in ts) for b, ts in enumerate(valid_tokens(data)) if ts]
    stat = [s if kind == "seq-tis" else s / len(ts) for s, ts in zip(log_sums, filter(None, valid_tokens(data)))]
    assert min(stat) < math.log(low) and max(stat) > math.log(high)
    assert any(math.log(low) < s < math.log(high) for s in stat)

    cfg = dict(mode, truncated_importance_sampling_ratio=high, token_level_loss=token_level, ratio_clip_min=CLIP)
    loss, grad, metrics = run_loss(cfg, logprobs, data)
    ref_loss, ref_grad, ref_ratio, ref_oob = reference(kind, token_level, logprobs, data, low, high)
    np.testing.assert_allclose(loss, ref_loss, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(grad, ref_grad, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(float(metrics["sampling_importance_ratio"]), ref_ratio, rtol=RTOL)
    np.testing.assert_allclose(float(metrics["is_oob_ratio"]), ref_oob, rtol=RTOL)
    assert 0 < ref_oob < 1

    # negative controls, far outside the tolerance: the mode changes the loss, and not as the uncorrected
    # loss or the nearest of NeMo-RL's modes (token tis; seq-mask-tis, which keeps the token weights) does
    uncorrected, _, _, _ = reference(None, token_level, logprobs, data)
    assert abs(loss - uncorrected) > 1e-3 * abs(loss)
    nearest = "tis" if kind == "seq-tis" else "seq-mask-tis"
    other, _, _ = run_loss(dict(cfg, truncated_importance_sampling_type=nearest), logprobs, data)
    assert abs(loss - other) > 1e-3 * abs(loss)


def test_seq_tis_truncates_a_weight_too_large_for_float32():
    """A long sequence's log-weight sum of 200 overflows exp in float32; it still truncates to ratio, not to 0."""
    logprobs, data = multi_turn_batch(dtype=torch.float32)
    ts = valid_tokens(data)[0]
    data["generation_logprobs"][0, ts] = data["prev_logprobs"][0, ts] - 200.0 / len(ts)
    cfg = dict(SEQ_TIS, truncated_importance_sampling_ratio=SEQ_TIS_HIGH, ratio_clip_min=CLIP)
    loss, grad, _ = run_loss(cfg, logprobs, data)
    ref_loss, ref_grad, _, _ = reference("seq-tis", True, logprobs, data, 0.5, SEQ_TIS_HIGH)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-8)
    assert abs(grad[0, ts]).sum() > 0  # the sequence counts, with weight ratio


def gap_reference(data, include_env: bool = False) -> dict[str, float]:
    """The gap metrics over the valid tokens (or, for the negative control, also the environment tokens)."""
    prev, gen = data["prev_logprobs"].double().numpy(), data["generation_logprobs"].double().numpy()
    keep = np.zeros(prev.shape, dtype=bool)
    for b, ts in enumerate(valid_tokens(data)):
        keep[b, ts] = True
        if include_env and ts:
            keep[b, ts[0] : ts[-1]] |= ~np.isnan(prev[b, ts[0] : ts[-1]])
    p_train, p_engine = np.exp(prev[keep]), np.exp(gen[keep])
    r = p_train / p_engine
    return {
        "rollout_probs_diff_mean": float(np.mean(np.abs(p_train - p_engine))),
        "rollout_probs_diff_max": float(np.max(np.abs(p_train - p_engine))),
        "k3_kl": float(np.mean(r - 1.0 - np.log(r))),
        PEARSON_NAME: float(np.corrcoef(p_train, p_engine)[0, 1]),
    }


@pytest.mark.parametrize("cfg", [{}, dict(GEO_MASK, truncated_importance_sampling_ratio=GEO_MASK_HIGH)])
def test_gap_metrics_match_float64_over_micro_batches(cfg):
    """Two micro-batches, summed as the training loop sums them, give the whole batch's metrics."""
    logprobs, data = multi_turn_batch(seed=1)
    gseqs, gtoks = counts(data)
    loss_fn = ClippedPGLossFn(dict(use_importance_sampling_correction=True, **cfg))
    per_micro_batch: dict[str, list[float]] = {}
    for rows in (slice(0, 4), slice(4, None)):
        part = {k: v[rows] for k, v in data.items()}
        _, metrics = loss_fn(logprobs[rows], part, gseqs, gtoks)
        for name, value in metrics.items():
            per_micro_batch.setdefault(name, []).append(float(value))
    step = step_metrics(per_micro_batch, steps=1)
    step[PEARSON_NAME] = probs_pearson(step)
    expected = gap_reference(data)
    for name, value in expected.items():
        np.testing.assert_allclose(step[name], value, rtol=1e-9, err_msg=name)
    assert 0.5 < expected[PEARSON_NAME] < 0.999  # the data have a gap, and a correlated one

    # negative controls: counting the environment tokens, or the other KL direction, gives other numbers
    with_env = gap_reference(data, include_env=True)
    for name in expected:
        assert abs(with_env[name] - expected[name]) > 1e-3, name
    prev, gen = data["prev_logprobs"].double().numpy(), data["generation_logprobs"].double().numpy()
    log_r = np.concatenate([gen[b, ts] - prev[b, ts] for b, ts in enumerate(valid_tokens(data))])
    assert abs(np.mean(np.expm1(log_r) - log_r) - step["k3_kl"]) > 1e-3  # k3 of KL(trainer || engine)


def test_pearson_needs_its_moments_and_variance():
    assert math.isnan(probs_pearson({}))
    flat = dict.fromkeys(
        (
            "rollout_probs_train_mean",
            "rollout_probs_engine_mean",
            "rollout_probs_train_sq_mean",
            "rollout_probs_engine_sq_mean",
            "rollout_probs_product_mean",
        ),
        0.25,
    )
    flat["rollout_probs_train_mean"] = flat["rollout_probs_engine_mean"] = 0.5  # both sides constant
    assert math.isnan(probs_pearson(flat))


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        (dict(truncated_importance_sampling_type="seq-tis"), "use_importance_sampling_correction"),
        (dict(truncated_importance_sampling_type="geo-mask"), "use_importance_sampling_correction"),
        (dict(truncated_importance_sampling_type="icepop"), "use_importance_sampling_correction"),
        (dict(truncated_importance_sampling_type="seq-mask-tis"), "use_importance_sampling_correction"),
        (
            dict(use_importance_sampling_correction=True, truncated_importance_sampling_type="seq-tis"),
            "needs truncated_importance_sampling_ratio",
        ),
        (
            dict(
                use_importance_sampling_correction=True,
                truncated_importance_sampling_type="geo-mask",
                truncated_importance_sampling_ratio=1.1,
            ),
            "needs truncated_importance_sampling_ratio_min",
        ),
        (
            dict(
                use_importance_sampling_correction=True,
                truncated_importance_sampling_type="seq-tis",
                truncated_importance_sampling_ratio=2.0,
                sequence_level_importance_ratios=True,
            ),
            "use 'tis'",
        ),
    ],
)
def test_config_refuses_what_a_mode_cannot_do(bad, says):
    with pytest.raises(ValidationError, match=says):
        ClippedPGLossConfig(**bad)


def test_config_accepts_the_modes():
    seq_tis = ClippedPGLossConfig(
        use_importance_sampling_correction=True,
        truncated_importance_sampling_type="seq-tis",
        truncated_importance_sampling_ratio=2.0,
    )
    assert seq_tis.truncated_importance_sampling_ratio_min is None  # 0: only the upper bound truncates
    ClippedPGLossConfig(
        use_importance_sampling_correction=True,
        sequence_level_importance_ratios=True,
        truncated_importance_sampling_type="geo-mask",
        truncated_importance_sampling_ratio_min=0.9,
        truncated_importance_sampling_ratio=1.1,
    )
