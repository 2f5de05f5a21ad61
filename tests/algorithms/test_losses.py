"""Tests for GRPO's loss (rlcore.algorithms.grpo.loss) and SFT's (rlcore.algorithms.sft.loss).

The reference below recomputes every loss token by token in float64 Python
(values *and* the gradient w.r.t. logprobs, written out by hand), without using
any helper of the implementation.
"""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from rlcore.algorithms.grpo.loss import ClippedPGLossFn, positive_example_token_counts
from rlcore.algorithms.grpo.loss_config import ClippedPGLossConfig
from rlcore.algorithms.sft.loss import NLLLoss
from rlcore.interfaces.loss import LossFunction, LossType, step_metrics

RTOL, ATOL = 1e-6, 1e-10

DEFAULTS = dict(
    reference_policy_kl_penalty=0.0,
    reference_policy_kl_type="k3",
    kl_input_clamp_value=20.0,
    kl_output_clamp_value=10.0,
    ratio_clip_min=0.2,
    ratio_clip_max=0.2,
    ratio_clip_c=None,
    use_on_policy_kl_approximation=False,
    use_importance_sampling_correction=False,
    truncated_importance_sampling_ratio=None,
    truncated_importance_sampling_ratio_min=None,
    truncated_importance_sampling_type="tis",
    token_level_loss=True,
    sequence_level_importance_ratios=False,
    disable_ppo_ratio=False,
    use_cispo=False,
    positive_example_nll_weight=0.0,
)


# --------------------------------------------------------------------------- data


def make_batch(seed: int, B: int = 8, S: int = 12, garbage: bool = False):
    """Random right-padded batch; row 1 has sample_mask 0; logprobs is a float64 leaf."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(4, S + 1, B)
    prompt = rng.integers(1, 3, B)
    prompt[0] = 0  # token_mask is 1 at position 0 there, which still never counts
    token_mask = np.zeros((B, S))
    for b in range(B):
        token_mask[b, prompt[b] : lengths[b]] = 1.0
        token_mask[b, rng.integers(prompt[b], lengths[b])] = 0.0  # a hole inside the response
    sample_mask = np.ones(B)
    sample_mask[1] = 0.0
    prev = -rng.uniform(0.7, 3.0, (B, S))
    logprobs = prev + rng.uniform(-0.6, 0.6, (B, S))
    data = dict(
        input_ids=torch.as_tensor(rng.integers(0, 50, (B, S))),
        input_lengths=torch.as_tensor(lengths),
        token_mask=torch.as_tensor(token_mask),
        sample_mask=torch.as_tensor(sample_mask),
        advantages=rng.normal(size=(B, S)),
        prev_logprobs=prev,
        generation_logprobs=prev + rng.uniform(-0.8, 0.8, (B, S)),
        reference_policy_logprobs=logprobs + rng.uniform(-1.5, 1.5, (B, S)),
    )
    # VAPO's inputs: rewards, and per row the count of valid tokens of rewarded rows in the (one-step) batch
    data["rewards"] = torch.as_tensor(rng.normal(size=B))
    positive_tokens = sum(
        1 for b in range(B) for t in range(1, S) if token_mask[b, t] and sample_mask[b] and data["rewards"][b] > 0
    )
    data["positive_example_token_count"] = torch.full((B,), float(positive_tokens))
    pad = np.arange(S)[None, :] >= lengths[:, None]
    logprobs[pad] = 0.0  # design.md §2.2: padding logprobs are 0
    if garbage:  # whatever sits off the mask must not matter
        for key, junk in [("advantages", np.nan), ("prev_logprobs", -np.inf), ("generation_logprobs", np.inf)]:
            data[key][pad] = junk
        logprobs[pad] = -np.inf
    for key in ["advantages", "prev_logprobs", "generation_logprobs", "reference_policy_logprobs"]:
        data[key] = torch.as_tensor(data[key])
    return torch.tensor(logprobs, requires_grad=True), data


def global_counts(data):
    tm, sm = data["token_mask"].numpy(), data["sample_mask"].numpy()
    toks = sum(1 for b in range(tm.shape[0]) for t in range(1, tm.shape[1]) if tm[b, t] and sm[b])
    return torch.tensor(float(sm.sum())), torch.tensor(float(toks))


# ---------------------------------------------------------------------- reference


def reference_pg(cfg, logprobs, data, gseqs, gtoks):
    """Loss, d loss / d logprobs and metrics of the clipped PG loss, token by token."""
    c = {**DEFAULTS, **cfg}
    lp = logprobs.detach().numpy()
    arr = {k: (v.numpy() if isinstance(v, torch.Tensor) else v) for k, v in data.items()}
    adv, prev = arr["advantages"], arr.get("prev_logprobs")
    gen, ref = arr.get("generation_logprobs"), arr.get("reference_policy_logprobs")
    B, S = lp.shape
    lo, hi, dual_c, beta = c["ratio_clip_min"], c["ratio_clip_max"], c["ratio_clip_c"], c["reference_policy_kl_penalty"]
    cin, cout = c["kl_input_clamp_value"], c["kl_output_clamp_value"]
    tis_type, w_lo, w_hi = (
        c["truncated_importance_sampling_type"],
        c["truncated_importance_sampling_ratio_min"],
        c["truncated_importance_sampling_ratio"],
    )
    ppo = not c["disable_ppo_ratio"]
    mismatch = gen is not None and prev is not None
    grad = np.zeros((B, S))
    names = ["loss", "actor_loss", "kl_loss", "kl_penalty", "approx_entropy", "num_valid_tokens", "num_valid_samples"]
    names += ["probs_ratio", "probs_ratio_clamped"] + (["clip_fraction"] if ppo else [])
    mu = c["positive_example_nll_weight"]
    if mu > 0:
        names += ["positive_nll_loss"]
        positive_count = sum(
            1
            for b in range(B)
            for t in range(1, S)
            if arr["token_mask"][b, t] and arr["sample_mask"][b] and arr["rewards"][b] > 0
        )
    if mismatch:
        names += [
            "token_mult_prob_error",
            "gen_kl_error",
            "policy_kl_error",
            "js_divergence_error",
            "sampling_importance_ratio",
            "rollout_probs_diff_mean",
            "k3_kl",
            "rollout_probs_train_mean",
            "rollout_probs_engine_mean",
            "rollout_probs_train_sq_mean",
            "rollout_probs_engine_sq_mean",
            "rollout_probs_product_mean",
        ] + (["is_oob_ratio"] if w_hi is not None else [])
    m = dict.fromkeys(names, 0.0)
    if mismatch:
        m["rollout_probs_diff_max"] = -math.inf
    ratios, clipped_ratios = [], []

    def k_of(y, kind):  # estimate and its derivative in y = log pi_ref - log pi
        return {"k1": (-y, -1.0), "k2": (0.5 * y * y, y), "k3": (math.exp(y) - y - 1.0, math.exp(y) - 1.0)}[kind]

    for b in range(B):
        if arr["sample_mask"][b] == 0:
            continue
        m["num_valid_samples"] += 1
        toks = [t for t in range(1, S) if arr["token_mask"][b, t] != 0]
        n = len(toks)
        if n == 0:
            continue
        scale = 1.0 / gtoks if c["token_level_loss"] else 1.0 / (n * gseqs)
        if c["sequence_level_importance_ratios"]:
            seq_log_ratio = sum(lp[b, t] - prev[b, t] for t in toks) / n
        if mismatch:
            seq_log_w = sum(prev[b, t] - gen[b, t] for t in toks)
            seq_keep = w_lo is not None and w_lo <= math.exp(seq_log_w / n) <= w_hi
            if c["sequence_level_importance_ratios"]:
                m["sampling_importance_ratio"] += (
                    min(max(math.exp(seq_log_w), w_lo or 0.0), w_hi)
                    if tis_type == "tis" and w_hi
                    else math.exp(seq_log_w) * (w_lo <= math.exp(seq_log_w) <= w_hi)
                    if tis_type == "icepop"
                    else math.exp(seq_log_w)
                ) / gseqs
            if tis_type == "seq-mask-tis":
                m["is_oob_ratio"] += (not seq_keep) / gseqs
        for t in toks:
            A, x = adv[b, t], lp[b, t]
            log_r = (
                seq_log_ratio
                if c["sequence_level_importance_ratios"]
                else (x - prev[b, t] if prev is not None else 0.0)
            )
            r = math.exp(log_r)
            cr = min(max(r, 1 - lo), 1 + hi)
            clipped = False
            if not ppo:
                a, da = -A * x, -A  # da: d actor / d log pi_t
            elif c["use_cispo"]:
                a, da, clipped = -A * cr * x, -A * cr, cr != r
            else:
                l1, l2 = -A * r, -A * cr
                a, da = (l1, -A * r) if l1 >= l2 else (l2, 0.0)
                clipped = l2 > l1
                if dual_c is not None and A < 0 and a > -A * dual_c:
                    a, da, clipped = -A * dual_c, 0.0, True
            if mismatch:
                raw_w = math.exp(seq_log_w if c["sequence_level_importance_ratios"] else prev[b, t] - gen[b, t])
                w, out = raw_w, None
                if w_hi is not None and tis_type == "tis":
                    w, out = min(max(raw_w, w_lo or 0.0), w_hi), not (w_lo or 0.0) <= raw_w <= w_hi
                elif w_hi is not None and tis_type == "icepop":
                    out = not w_lo <= raw_w <= w_hi
                    w = 0.0 if out else raw_w
                elif w_hi is not None:  # seq-mask-tis
                    w = raw_w if seq_keep else 0.0
                if not c["sequence_level_importance_ratios"]:
                    m["sampling_importance_ratio"] += w / gtoks
                if out is not None:
                    m["is_oob_ratio"] += out / gtoks
                d = gen[b, t] - prev[b, t]
                m["token_mult_prob_error"] += math.exp(abs(d)) / gtoks
                m["gen_kl_error"] += k_of(-d, c["reference_policy_kl_type"])[0] / gtoks
                m["policy_kl_error"] += k_of(d, c["reference_policy_kl_type"])[0] / gtoks
                p_prev, p_gen = math.exp(prev[b, t]), math.exp(gen[b, t])
                mix = 0.5 * (p_prev + p_gen)
                m["js_divergence_error"] += 0.5 * (p_prev / mix - math.log(p_prev / mix) - 1) / gtoks
                m["js_divergence_error"] += 0.5 * (p_gen / mix - math.log(p_gen / mix) - 1) / gtoks
                m["rollout_probs_diff_mean"] += abs(p_prev - p_gen) / gtoks
                m["rollout_probs_diff_max"] = max(m["rollout_probs_diff_max"], abs(p_prev - p_gen))
                m["k3_kl"] += (p_prev / p_gen - 1 - math.log(p_prev / p_gen)) / gtoks
                m["rollout_probs_train_mean"] += p_prev / gtoks
                m["rollout_probs_engine_mean"] += p_gen / gtoks
                m["rollout_probs_train_sq_mean"] += p_prev * p_prev / gtoks
                m["rollout_probs_engine_sq_mean"] += p_gen * p_gen / gtoks
                m["rollout_probs_product_mean"] += p_prev * p_gen / gtoks
                if c["use_importance_sampling_correction"]:
                    a, da = a * w, da * w
            if c["sequence_level_importance_ratios"]:  # d log r / d log pi_u = 1/n for every u
                for u in toks:
                    grad[b, u] += scale * da / n
            else:
                grad[b, t] += scale * da
            kw = 0.0
            if beta > 0:
                if c["use_on_policy_kl_approximation"]:
                    q = gen[b, t] if gen is not None else prev[b, t]
                    wk = dwk = math.exp(x - q)
                else:
                    wk, dwk = 1.0, 1.0  # value 1, score-function gradient
                y, dy = ref[b, t] - x, -1.0
                if cin is not None and abs(y) > cin:  # clamped: no gradient through k nor through its weight
                    y, dy, dwk = math.copysign(cin, y), 0.0, 0.0
                k, dk_dy = k_of(y, c["reference_policy_kl_type"])
                kw, dkw = wk * k, dwk * k + wk * dk_dy * dy
                if cout is not None and abs(kw) > cout:
                    kw, dkw = math.copysign(cout, kw), 0.0
                grad[b, t] += scale * beta * dkw
            m["actor_loss"] += scale * a
            m["kl_penalty"] += scale * kw
            if mu > 0 and arr["rewards"][b] > 0:
                m["positive_nll_loss"] += -x / positive_count
                grad[b, t] += -mu / positive_count
            if ppo:
                m["probs_ratio"] += r / gtoks
                m["probs_ratio_clamped"] += cr / gtoks
                m["clip_fraction"] += clipped / gtoks
                ratios.append(r)
                clipped_ratios.append(cr)
            else:  # REINFORCE: NeMo-RL reports log pi under the ratio's names
                m["probs_ratio"] += x / gtoks
                m["probs_ratio_clamped"] += x / gtoks
                ratios.append(x)
                clipped_ratios.append(x)
            q = gen if gen is not None else prev
            m["approx_entropy"] += -(math.exp(x - q[b, t]) if q is not None else 1.0) * x / gtoks
            m["num_valid_tokens"] += 1
    m["kl_loss"] = beta * m["kl_penalty"]
    m["loss"] = m["actor_loss"] + m["kl_loss"] + (mu * m["positive_nll_loss"] if mu > 0 else 0.0)
    if ratios:
        m.update(
            probs_ratio_min=min(ratios),
            probs_ratio_max=max(ratios),
            probs_ratio_clamped_min=min(clipped_ratios),
            probs_ratio_clamped_max=max(clipped_ratios),
        )
    return m["loss"], grad, m


def check_against_reference(cfg, logprobs, data):
    gseqs, gtoks = global_counts(data)
    loss, metrics = ClippedPGLossFn(cfg)(logprobs, data, gseqs, gtoks)
    loss.backward()
    ref_loss, ref_grad, ref_metrics = reference_pg(cfg, logprobs, data, float(gseqs), float(gtoks))
    np.testing.assert_allclose(loss.item(), ref_loss, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(logprobs.grad.numpy(), ref_grad, rtol=RTOL, atol=ATOL)
    assert set(metrics) == set(ref_metrics)
    for key, value in ref_metrics.items():
        np.testing.assert_allclose(metrics[key], value, rtol=RTOL, atol=ATOL, err_msg=key)
    return metrics


# -------------------------------------------------------------- against reference

TOKEN_AND_SEQ = pytest.mark.parametrize("token_level", [True, False], ids=["tok", "seq"])


@TOKEN_AND_SEQ
@pytest.mark.parametrize("clip", [(0.2, 0.2), (0.1, 0.28)])
def test_ppo_clip(token_level, clip):
    logprobs, data = make_batch(0)
    # The data exercise both advantage signs on both sides of the clip range.
    r = torch.exp(logprobs - data["prev_logprobs"]).detach()
    valid = (data["token_mask"] * data["sample_mask"][:, None]).bool()
    valid[:, 0] = False
    for above in (r > 1 + clip[1], r < 1 - clip[0]):
        for sign in (data["advantages"] > 0, data["advantages"] < 0):
            assert (above & sign & valid).any()
    metrics = check_against_reference(
        dict(ratio_clip_min=clip[0], ratio_clip_max=clip[1], token_level_loss=token_level), logprobs, data
    )
    assert 0 < metrics["clip_fraction"] < 1


@TOKEN_AND_SEQ
def test_dual_clip(token_level):
    logprobs, data = make_batch(1)
    r = torch.exp(logprobs - data["prev_logprobs"]).detach()
    assert ((r > 1.3) & (data["advantages"] < 0) & (data["token_mask"] > 0)).any()
    check_against_reference(dict(ratio_clip_c=1.3, token_level_loss=token_level), logprobs, data)


@pytest.mark.parametrize("kl_type", ["k1", "k2", "k3"])
@pytest.mark.parametrize("clamps", [(20.0, 10.0), (0.4, 0.15), (None, None)], ids=["default", "tight", "none"])
@pytest.mark.parametrize("on_policy", [False, True], ids=["off_policy_kl", "on_policy_kl"])
def test_kl_penalty(kl_type, clamps, on_policy):
    logprobs, data = make_batch(2)
    cfg = dict(
        reference_policy_kl_penalty=0.3,
        reference_policy_kl_type=kl_type,
        kl_input_clamp_value=clamps[0],
        kl_output_clamp_value=clamps[1],
        use_on_policy_kl_approximation=on_policy,
        token_level_loss=kl_type != "k2",  # cover both normalisations
    )
    metrics = check_against_reference(cfg, logprobs, data)
    assert metrics["kl_penalty"] != 0.0


def test_on_policy_kl_falls_back_to_prev_logprobs():
    logprobs, data = make_batch(3)
    del data["generation_logprobs"]
    check_against_reference(dict(reference_policy_kl_penalty=0.1, use_on_policy_kl_approximation=True), logprobs, data)


@TOKEN_AND_SEQ
@pytest.mark.parametrize(
    "is_cfg",
    [
        dict(truncated_importance_sampling_type="tis"),
        dict(truncated_importance_sampling_type="tis", truncated_importance_sampling_ratio=1.3),
        dict(
            truncated_importance_sampling_type="icepop",
            truncated_importance_sampling_ratio_min=0.7,
            truncated_importance_sampling_ratio=1.4,
        ),
        dict(
            truncated_importance_sampling_type="tis",
            truncated_importance_sampling_ratio_min=0.8,
            truncated_importance_sampling_ratio=1.3,
        ),
        dict(
            truncated_importance_sampling_type="seq-mask-tis",
            truncated_importance_sampling_ratio_min=0.95,
            truncated_importance_sampling_ratio=1.1,
        ),
    ],
    ids=["is", "tis", "icepop", "tis_min", "seq_mask_tis"],
)
def test_importance_sampling(token_level, is_cfg):
    logprobs, data = make_batch(4)
    w = torch.exp(data["prev_logprobs"] - data["generation_logprobs"])
    assert ((w > 1.4) & (data["token_mask"] > 0)).any() and ((w < 0.7) & (data["token_mask"] > 0)).any()
    cfg = dict(use_importance_sampling_correction=True, token_level_loss=token_level, **is_cfg)
    check_against_reference(cfg, logprobs, data)


@TOKEN_AND_SEQ
def test_gspo_sequence_ratios(token_level):
    logprobs, data = make_batch(5)
    cfg = dict(
        sequence_level_importance_ratios=True, ratio_clip_min=0.05, ratio_clip_max=0.05, token_level_loss=token_level
    )
    metrics = check_against_reference(cfg, logprobs, data)
    assert 0 < metrics["clip_fraction"] < 1


@pytest.mark.parametrize(
    "truncation",
    [
        {},
        dict(truncated_importance_sampling_ratio=1.5),
        dict(
            truncated_importance_sampling_type="icepop",
            truncated_importance_sampling_ratio_min=0.5,
            truncated_importance_sampling_ratio=2.0,
        ),
    ],
    ids=["raw", "tis", "icepop"],
)
def test_gspo_importance_weight_is_one_per_sequence(truncation):
    """With GSPO the correction weighs a sequence by exp(sum_t log pi_prev - log pi_gen), and tis/icepop act on
    that one weight (NeMo-RL's semantics), not on the token weights."""
    logprobs, data = make_batch(14)
    cfg = dict(
        sequence_level_importance_ratios=True,
        token_level_loss=False,
        use_importance_sampling_correction=True,
        **truncation,
    )
    metrics = check_against_reference(cfg, logprobs, data)
    valid = (data["token_mask"] * data["sample_mask"][:, None]).bool()
    valid[:, 0] = False
    seq_w = torch.exp(((data["prev_logprobs"] - data["generation_logprobs"]) * valid).sum(-1))
    rows = data["sample_mask"].bool()
    assert (seq_w[rows] > 2.0).any() and (seq_w[rows] < 0.5).any()  # both bounds bind on these data
    if not truncation:
        assert metrics["sampling_importance_ratio"] == pytest.approx(float(seq_w[rows].mean()), rel=1e-9)
    else:
        assert 0 < metrics["is_oob_ratio"] < 1


def test_seq_mask_tis_keeps_some_sequences_and_drops_others():
    logprobs, data = make_batch(4)
    valid = (data["token_mask"] * data["sample_mask"][:, None]).bool()
    valid[:, 0] = False
    log_w = (data["prev_logprobs"] - data["generation_logprobs"]) * valid
    geo = torch.exp(log_w.sum(-1) / valid.sum(-1))[data["sample_mask"].bool()]
    kept = ((geo >= 0.95) & (geo <= 1.1)).double().mean()
    cfg = dict(
        use_importance_sampling_correction=True,
        truncated_importance_sampling_type="seq-mask-tis",
        truncated_importance_sampling_ratio_min=0.95,
        truncated_importance_sampling_ratio=1.1,
    )
    metrics = check_against_reference(cfg, logprobs, data)
    assert 0 < kept < 1
    assert metrics["is_oob_ratio"] == pytest.approx(1 - float(kept))


@TOKEN_AND_SEQ
@pytest.mark.parametrize("kl_type", ["k1", "k3"])
def test_kl_clamps_bound_the_weighted_estimate_and_stop_its_gradient(token_level, kl_type):
    """NeMo-RL's calculate_kl: the output clamp bounds w * k (not k), and where either clamp binds the token
    gets no KL gradient at all, through k or through its sampling weight w."""
    logprobs, data = make_batch(15)
    cfg = ClippedPGLossConfig(
        reference_policy_kl_penalty=1.0,
        reference_policy_kl_type=kl_type,
        kl_input_clamp_value=0.6,
        kl_output_clamp_value=0.3,
        use_on_policy_kl_approximation=True,
        token_level_loss=token_level,
        ratio_clip_min=0.0,
        ratio_clip_max=0.0,
    )  # actor gradient 0 where clipped
    check_against_reference(cfg.model_dump(), logprobs, data)
    gseqs, gtoks = global_counts(data)
    data["advantages"] = torch.zeros_like(data["advantages"])  # the KL term alone
    loss, metrics = ClippedPGLossFn(cfg)(logprobs, data, gseqs, gtoks)
    (grad,) = torch.autograd.grad(loss, logprobs)
    lp = logprobs.detach()
    valid = (data["token_mask"] * data["sample_mask"][:, None]).bool()
    valid[:, 0] = False
    log_r = data["reference_policy_logprobs"] - lp
    y = log_r.clamp(-0.6, 0.6)
    k = -y if kl_type == "k1" else torch.expm1(y) - y
    weighted = torch.exp(lp - data["generation_logprobs"]) * k
    bound = valid & ((log_r.abs() > 0.6) | (weighted.abs() > 0.3))
    assert bound.any() and (valid & ~bound).any()
    assert (grad[bound] == 0).all() and (grad[valid & ~bound] != 0).all()
    assert abs(metrics["kl_penalty"]) <= 0.3 + 1e-12  # a mean of values each within the output clamp
    assert metrics["kl_loss"] == pytest.approx(metrics["kl_penalty"])  # beta = 1


@TOKEN_AND_SEQ
def test_kl_penalty_is_the_kl_and_kl_loss_its_beta_scaled_term(token_level):
    logprobs, data = make_batch(2)
    cfg = dict(reference_policy_kl_penalty=0.25, token_level_loss=token_level)
    gseqs, gtoks = global_counts(data)
    _, metrics = ClippedPGLossFn(cfg)(logprobs, data, gseqs, gtoks)
    metrics = {name: float(value) for name, value in metrics.items()}  # 0-dim tensors, as the loop reads them
    assert metrics["kl_loss"] == pytest.approx(0.25 * metrics["kl_penalty"], rel=1e-12)
    assert metrics["loss"] == pytest.approx(metrics["actor_loss"] + metrics["kl_loss"], rel=1e-12)


@pytest.mark.parametrize("clip", [(0.2, 0.2), (0.1, 0.28)])
def test_cispo(clip):
    """CISPO: -A * sg(clip(r)) * log pi, so a clipped token keeps a gradient, scaled by its clipped ratio."""
    logprobs, data = make_batch(16)
    cfg = dict(
        use_cispo=True,
        ratio_clip_min=clip[0],
        ratio_clip_max=clip[1],
        reference_policy_kl_penalty=0.1,
        use_importance_sampling_correction=True,
        truncated_importance_sampling_ratio=1.5,
    )
    metrics = check_against_reference(cfg, logprobs, data)
    assert 0 < metrics["clip_fraction"] < 1


@TOKEN_AND_SEQ
def test_vapo_positive_example_nll(token_level):
    """VAPO: mu times the mean NLL over the step's tokens of completions with reward > 0."""
    logprobs, data = make_batch(17)
    rewarded = data["rewards"][data["sample_mask"].bool()] > 0
    assert rewarded.any() and not rewarded.all()
    metrics = check_against_reference(
        dict(positive_example_nll_weight=0.3, reference_policy_kl_penalty=0.1, token_level_loss=token_level),
        logprobs,
        data,
    )
    assert metrics["positive_nll_loss"] > 0
    # the loop's helper gives every row its step's count: here the batch is one step
    counts = positive_example_token_counts(data["token_mask"], data["sample_mask"], data["rewards"], 8)
    torch.testing.assert_close(counts.double(), data["positive_example_token_count"].double())
    two_steps = positive_example_token_counts(data["token_mask"], data["sample_mask"], data["rewards"], 4)
    assert two_steps[0] + two_steps[4] == counts[0] and two_steps[0] != two_steps[4]


def test_vapo_needs_its_inputs():
    logprobs, data = make_batch(17)
    del data["positive_example_token_count"]
    gseqs, gtoks = global_counts(data)
    with pytest.raises(KeyError, match="positive_example_token_count.*positive_example_token_counts"):
        ClippedPGLossFn(dict(positive_example_nll_weight=0.3))(logprobs, data, gseqs, gtoks)


@pytest.mark.parametrize("with_is", [False, True])
def test_reinforce(with_is):
    logprobs, data = make_batch(6)
    cfg = dict(disable_ppo_ratio=True, use_importance_sampling_correction=with_is, reference_policy_kl_penalty=0.05)
    if not with_is:
        del data["prev_logprobs"]  # REINFORCE needs no old policy
    check_against_reference(cfg, logprobs, data)


def test_everything_at_once():
    logprobs, data = make_batch(7)
    cfg = dict(
        ratio_clip_min=0.1,
        ratio_clip_max=0.3,
        ratio_clip_c=2.0,
        reference_policy_kl_penalty=0.2,
        reference_policy_kl_type="k3",
        kl_input_clamp_value=1.0,
        kl_output_clamp_value=0.5,
        use_on_policy_kl_approximation=True,
        use_importance_sampling_correction=True,
        truncated_importance_sampling_ratio=1.5,
        token_level_loss=False,
    )
    check_against_reference(cfg, logprobs, data)


def test_nll():
    logprobs, data = make_batch(8)
    gseqs, gtoks = global_counts(data)
    loss, metrics = NLLLoss()(logprobs, data, gseqs, gtoks)
    loss.backward()
    lp, tm, sm = logprobs.detach().numpy(), data["token_mask"].numpy(), data["sample_mask"].numpy()
    total, count, grad = 0.0, 0, np.zeros_like(lp)
    for b in range(lp.shape[0]):
        for t in range(1, lp.shape[1]):
            if tm[b, t] and sm[b]:
                total -= lp[b, t]
                grad[b, t] = -1.0 / float(gtoks)
                count += 1
    np.testing.assert_allclose(loss.item(), total / count, rtol=RTOL)
    np.testing.assert_allclose(logprobs.grad.numpy(), grad, rtol=RTOL, atol=ATOL)
    assert metrics == {"loss": pytest.approx(total / count, rel=RTOL), "num_valid_tokens": count}
    assert NLLLoss.loss_type is LossType.TOKEN_LEVEL


# -------------------------------------------- micro-batch / dp-rank invariance


INVARIANCE_CFGS = {
    "token_all": dict(
        ratio_clip_c=2.0,
        reference_policy_kl_penalty=0.2,
        use_on_policy_kl_approximation=True,
        use_importance_sampling_correction=True,
        truncated_importance_sampling_ratio=1.5,
    ),
    "seq_all": dict(
        token_level_loss=False,
        ratio_clip_c=2.0,
        reference_policy_kl_penalty=0.2,
        reference_policy_kl_type="k2",
        use_importance_sampling_correction=True,
        truncated_importance_sampling_type="icepop",
        truncated_importance_sampling_ratio=1.4,
        truncated_importance_sampling_ratio_min=0.7,
    ),
    "gspo_seq": dict(token_level_loss=False, sequence_level_importance_ratios=True, reference_policy_kl_penalty=0.1),
    "reinforce": dict(disable_ppo_ratio=True, reference_policy_kl_penalty=0.1),
    "cispo_seq_mask_tis": dict(
        use_cispo=True,
        reference_policy_kl_penalty=0.1,
        use_importance_sampling_correction=True,
        truncated_importance_sampling_type="seq-mask-tis",
        truncated_importance_sampling_ratio_min=0.95,
        truncated_importance_sampling_ratio=1.1,
    ),
    "vapo": dict(positive_example_nll_weight=0.5, reference_policy_kl_penalty=0.1),
    "gspo_is": dict(
        token_level_loss=False,
        sequence_level_importance_ratios=True,
        use_importance_sampling_correction=True,
        truncated_importance_sampling_ratio=1.5,
    ),
    "nll": None,
}

B_INV = 12
SPLITS = {
    "whole": [list(range(B_INV))],
    "singles": [[i] for i in range(B_INV)],
    "uneven": [list(range(0, 5)), list(range(5, 12))],
    "ragged": [[0, 1], [2, 3, 4, 5, 6], [7], [8, 9, 10, 11]],
    # two dp ranks taking interleaved rows, micro-batches of 2 and 4
    "dp2_interleaved": [[0, 2], [4, 6], [8, 10], [1, 3, 5, 7], [9, 11]],
    # three dp ranks of 4 rows each, micro-batch size 3 (3 + 1 per rank)
    "dp3_mbs3": [[0, 1, 2], [3], [4, 5, 6], [7], [8, 9, 10], [11]],
}


def make_fn(name):
    return NLLLoss() if INVARIANCE_CFGS[name] is None else ClippedPGLossFn(INVARIANCE_CFGS[name])


def run_split(loss_fn, logprobs, data, groups):
    """Sum losses, gradients and metrics over micro-batches with the step's global counts.

    Each micro-batch is also trimmed to its own longest sequence, as dynamic
    batching does, so the padded length differs between micro-batches.
    """
    gseqs, gtoks = global_counts(data)
    logprobs.grad = None
    total, metrics = 0.0, {}
    for rows in groups:
        idx = torch.tensor(rows)
        width = int(data["input_lengths"][idx].max())
        mb = {k: (v[idx][:, :width] if v.dim() == 2 else v[idx]) for k, v in data.items()}
        loss, m = loss_fn(logprobs[idx][:, :width], mb, gseqs, gtoks)
        loss.backward()
        total += loss.item()
        for k, v in m.items():
            metrics.setdefault(k, []).append(v)
    return total, logprobs.grad.clone(), step_metrics(metrics, 1)


@pytest.mark.parametrize("cfg_name", list(INVARIANCE_CFGS))
def test_microbatch_and_dp_invariance(cfg_name):
    logprobs, data = make_batch(9, B=B_INV, S=10)
    loss_fn = make_fn(cfg_name)
    whole_loss, whole_grad, whole_metrics = run_split(loss_fn, logprobs, data, SPLITS["whole"])
    assert whole_grad.abs().sum() > 0
    for split_name, groups in SPLITS.items():
        loss, grad, metrics = run_split(loss_fn, logprobs, data, groups)
        np.testing.assert_allclose(loss, whole_loss, rtol=RTOL, atol=ATOL, err_msg=split_name)
        np.testing.assert_allclose(grad.numpy(), whole_grad.numpy(), rtol=RTOL, atol=ATOL, err_msg=split_name)
        assert set(metrics) == set(whole_metrics)
        for k in metrics:
            np.testing.assert_allclose(metrics[k], whole_metrics[k], rtol=RTOL, atol=ATOL, err_msg=f"{split_name}:{k}")


@settings(max_examples=15, deadline=None)
@given(
    perm_seed=st.integers(0, 2**16),
    cuts=st.lists(st.integers(1, B_INV - 1), max_size=5),
    cfg_name=st.sampled_from(["token_all", "seq_all", "gspo_seq"]),
)
def test_random_splits_invariance(perm_seed, cuts, cfg_name):
    logprobs, data = make_batch(10, B=B_INV, S=8)
    loss_fn = make_fn(cfg_name)
    whole_loss, whole_grad, _ = run_split(loss_fn, logprobs, data, SPLITS["whole"])
    order = np.random.default_rng(perm_seed).permutation(B_INV).tolist()
    bounds = [0, *sorted(set(cuts)), B_INV]
    groups = [order[a:b] for a, b in zip(bounds, bounds[1:])]
    loss, grad, _ = run_split(loss_fn, logprobs, data, groups)
    np.testing.assert_allclose(loss, whole_loss, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(grad.numpy(), whole_grad.numpy(), rtol=RTOL, atol=ATOL)


# ------------------------------------------------------------ gradients, masking


@pytest.mark.parametrize("cfg_name", list(INVARIANCE_CFGS))
def test_gradient_only_through_logprobs_and_valid_tokens(cfg_name):
    logprobs, data = make_batch(11, garbage=True)  # NaN / inf off the mask, in data and logprobs
    for key in ["advantages", "prev_logprobs", "generation_logprobs", "reference_policy_logprobs"]:
        data[key].requires_grad_(True)
    gseqs, gtoks = global_counts(data)
    loss, metrics = make_fn(cfg_name)(logprobs, data, gseqs, gtoks)
    loss.backward()
    assert torch.isfinite(loss) and all(math.isfinite(v) for v in metrics.values())
    for key in ["advantages", "prev_logprobs", "generation_logprobs", "reference_policy_logprobs"]:
        assert data[key].grad is None, key
    valid = (data["token_mask"] * data["sample_mask"][:, None]).bool()
    valid[:, 0] = False
    grad = logprobs.grad
    assert torch.isfinite(grad).all()
    assert (grad[~valid] == 0).all()
    assert (grad[valid] != 0).any()


def test_no_valid_tokens_gives_zero_not_nan():
    logprobs, data = make_batch(12)
    data["sample_mask"] = torch.zeros_like(data["sample_mask"])
    loss, metrics = ClippedPGLossFn(dict(reference_policy_kl_penalty=0.1))(
        logprobs, data, torch.tensor(0), torch.tensor(0)
    )
    loss.backward()
    assert loss.item() == 0.0 and metrics["num_valid_tokens"] == 0
    assert (logprobs.grad == 0).all()


# ------------------------------------------------------------- config, protocol


def test_protocol_and_loss_type():
    assert isinstance(ClippedPGLossFn(), LossFunction)
    assert isinstance(NLLLoss(), LossFunction)
    assert ClippedPGLossFn({"token_level_loss": True}).loss_type is LossType.TOKEN_LEVEL
    assert ClippedPGLossFn(ClippedPGLossConfig(token_level_loss=False)).loss_type is LossType.SEQUENCE_LEVEL


@pytest.mark.parametrize(
    "bad",
    [
        dict(ratio_clip_c=1.0),
        dict(ratio_clip_min=1.0),
        dict(ratio_clip_max=-0.1),
        dict(reference_policy_kl_penalty=-1.0),
        dict(reference_policy_kl_type="k4"),
        dict(kl_input_clamp_value=0.0),
        dict(truncated_importance_sampling_ratio=2.0),  # IS correction is off
        dict(
            use_importance_sampling_correction=True,
            truncated_importance_sampling_type="icepop",
            truncated_importance_sampling_ratio=2.0,
        ),  # no lower bound
        dict(
            use_importance_sampling_correction=True,
            truncated_importance_sampling_type="icepop",
            truncated_importance_sampling_ratio=0.5,
            truncated_importance_sampling_ratio_min=2.0,
        ),
        dict(use_importance_sampling_correction=True, truncated_importance_sampling_ratio_min=0.5),  # tis
        dict(disable_ppo_ratio=True, ratio_clip_c=3.0),
        dict(disable_ppo_ratio=True, sequence_level_importance_ratios=True),
        dict(
            use_importance_sampling_correction=True,
            truncated_importance_sampling_type="seq-mask-tis",
            truncated_importance_sampling_ratio=1.1,
        ),  # no lower bound
        dict(
            use_importance_sampling_correction=True,
            truncated_importance_sampling_type="seq-mask-tis",
            truncated_importance_sampling_ratio_min=0.9,
            truncated_importance_sampling_ratio=1.1,
            sequence_level_importance_ratios=True,
        ),
        dict(
            use_importance_sampling_correction=True,
            truncated_importance_sampling_ratio_min=1.2,
            truncated_importance_sampling_ratio=1.1,
        ),  # min > max
        dict(use_cispo=True, disable_ppo_ratio=True),
        dict(use_cispo=True, sequence_level_importance_ratios=True),
        dict(use_cispo=True, ratio_clip_c=3.0),
        dict(use_cispo=True, token_level_loss=False),
        dict(ratio_clip=0.2),  # unknown key
    ],
)
def test_config_rejects(bad):
    with pytest.raises(ValidationError):
        ClippedPGLossConfig(**bad)


def test_missing_inputs_are_named():
    logprobs, data = make_batch(13)
    gseqs, gtoks = global_counts(data)
    del data["reference_policy_logprobs"]
    with pytest.raises(KeyError, match="reference_policy_logprobs"):
        ClippedPGLossFn(dict(reference_policy_kl_penalty=0.1))(logprobs, data, gseqs, gtoks)
    del data["generation_logprobs"]
    with pytest.raises(KeyError, match="generation_logprobs"):
        ClippedPGLossFn(dict(use_importance_sampling_correction=True))(logprobs, data, gseqs, gtoks)


@pytest.mark.parametrize(
    "module", ["rlcore.algorithms.grpo.loss", "rlcore.algorithms.sft.loss", "rlcore.algorithms.loss_functions"]
)
def test_import_does_not_import_torch(module):
    code = f"import sys, {module}; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_losses_keep_their_public_import_place():
    """``rlcore.algorithms.loss_functions`` (the README's path) names the same classes as their packages."""
    import rlcore.algorithms.loss_functions as public

    assert (public.NLLLoss, public.ClippedPGLossFn, public.ClippedPGLossConfig) == (
        NLLLoss,
        ClippedPGLossFn,
        ClippedPGLossConfig,
    )


def test_force_on_policy_ratio_equals_prev_logprobs_set_to_the_current_ones():
    """The forced ratio is the one the loss would get from prev_logprobs == the current (detached) logprobs."""
    cfg = ClippedPGLossConfig(force_on_policy_ratio=True, reference_policy_kl_penalty=0.1)
    logprobs, data = make_batch(3)
    gseqs, gtoks = global_counts(data)
    del data["prev_logprobs"]
    loss, metrics = ClippedPGLossFn(cfg)(logprobs, data, gseqs, gtoks)
    (grad,) = torch.autograd.grad(loss, logprobs)

    logprobs2 = logprobs.detach().clone().requires_grad_(True)
    explicit = dict(data, prev_logprobs=logprobs.detach().clone())
    plain = ClippedPGLossConfig(reference_policy_kl_penalty=0.1)
    loss2, metrics2 = ClippedPGLossFn(plain)(logprobs2, explicit, gseqs, gtoks)
    (grad2,) = torch.autograd.grad(loss2, logprobs2)
    assert metrics["probs_ratio"] == pytest.approx(metrics2["probs_ratio"]) and metrics["clip_fraction"] == 0.0
    torch.testing.assert_close(loss, loss2)
    torch.testing.assert_close(grad, grad2)
    assert grad.abs().sum() > 0
