"""Tests for rlcore.algorithms.loss_functions.

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

from rlcore.algorithms.loss_functions import ClippedPGLossConfig, ClippedPGLossFn, NLLLoss
from rlcore.interfaces.loss import LossFunction, LossType

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
    grad = np.zeros((B, S))
    m = dict(loss=0.0, actor_loss=0.0, kl_penalty=0.0, probs_ratio=0.0, probs_ratio_clamped=0.0,
             clip_fraction=0.0, approx_entropy=0.0, token_mult_prob_error=0.0, num_valid_tokens=0.0)
    for b in range(B):
        toks = [t for t in range(1, S) if arr["token_mask"][b, t] != 0 and arr["sample_mask"][b] != 0]
        n = len(toks)
        if n == 0:
            continue
        scale = 1.0 / gtoks if c["token_level_loss"] else 1.0 / (n * gseqs)
        if c["sequence_level_importance_ratios"]:
            seq_log_ratio = sum(lp[b, t] - prev[b, t] for t in toks) / n
        for t in toks:
            A, x = adv[b, t], lp[b, t]
            log_r = seq_log_ratio if c["sequence_level_importance_ratios"] else (x - prev[b, t] if prev is not None else 0.0)
            r = math.exp(log_r)
            cr = min(max(r, 1 - lo), 1 + hi)
            clipped = False
            if c["disable_ppo_ratio"]:
                a, da = -A * x, -A  # da: d actor / d log pi_t
            else:
                l1, l2 = -A * r, -A * cr
                a, da = (l1, -A * r) if l1 >= l2 else (l2, 0.0)
                clipped = l2 > l1
                if dual_c is not None and A < 0 and a > -A * dual_c:
                    a, da, clipped = -A * dual_c, 0.0, True
            w = 1.0
            if c["use_importance_sampling_correction"]:
                w = raw_w = math.exp(prev[b, t] - gen[b, t])
                if c["truncated_importance_sampling_type"] == "icepop":
                    keep = c["truncated_importance_sampling_ratio_min"] <= w <= c["truncated_importance_sampling_ratio"]
                    w = w if keep else 0.0
                elif c["truncated_importance_sampling_ratio"] is not None:
                    w = min(w, c["truncated_importance_sampling_ratio"])
                m["is_weight_mean"] = m.get("is_weight_mean", 0.0) + w / gtoks
                m["is_truncated_fraction"] = m.get("is_truncated_fraction", 0.0) + (w != raw_w) / gtoks
            a, da = a * w, da * w
            if c["sequence_level_importance_ratios"]:  # d log r / d log pi_u = 1/n for every u
                for u in toks:
                    grad[b, u] += scale * da / n
            else:
                grad[b, t] += scale * da
            kl_term = 0.0
            if beta > 0:
                y, dy = ref[b, t] - x, -1.0
                if cin is not None and abs(y) > cin:
                    y, dy = math.copysign(cin, y), 0.0
                k, dk = {
                    "k1": (-y, -dy),
                    "k2": (0.5 * y * y, y * dy),
                    "k3": (math.exp(y) - y - 1.0, (math.exp(y) - 1.0) * dy),
                }[c["reference_policy_kl_type"]]
                if cout is not None and abs(k) > cout:
                    k, dk = math.copysign(cout, k), 0.0
                if c["use_on_policy_kl_approximation"]:
                    q = gen[b, t] if gen is not None else prev[b, t]
                    wk = dwk = math.exp(x - q)
                else:
                    wk, dwk = 1.0, 1.0  # value 1, score-function gradient
                kl_term = beta * wk * k
                grad[b, t] += scale * beta * (dwk * k + wk * dk)
            m["actor_loss"] += scale * a
            m["kl_penalty"] += scale * kl_term
            m["probs_ratio"] += r / gtoks
            m["probs_ratio_clamped"] += cr / gtoks
            m["clip_fraction"] += clipped / gtoks
            q = gen if gen is not None else prev
            m["approx_entropy"] += -(math.exp(x - q[b, t]) if q is not None else 1.0) * x / gtoks
            if gen is not None and prev is not None:
                m["token_mult_prob_error"] += math.exp(abs(gen[b, t] - prev[b, t])) / gtoks
            m["num_valid_tokens"] += 1
    m["loss"] = m["actor_loss"] + m["kl_penalty"]
    if gen is None or prev is None:
        del m["token_mult_prob_error"]
    if c["use_importance_sampling_correction"]:
        m.setdefault("is_weight_mean", 0.0)
        m.setdefault("is_truncated_fraction", 0.0)
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
    check_against_reference(
        dict(reference_policy_kl_penalty=0.1, use_on_policy_kl_approximation=True), logprobs, data
    )


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
    ],
    ids=["is", "tis", "icepop"],
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
    cfg = dict(sequence_level_importance_ratios=True, ratio_clip_min=0.05, ratio_clip_max=0.05,
               token_level_loss=token_level)
    metrics = check_against_reference(cfg, logprobs, data)
    assert 0 < metrics["clip_fraction"] < 1


@pytest.mark.parametrize("with_is", [False, True])
def test_reinforce(with_is):
    logprobs, data = make_batch(6)
    cfg = dict(disable_ppo_ratio=True, use_importance_sampling_correction=with_is,
               reference_policy_kl_penalty=0.05)
    if not with_is:
        del data["prev_logprobs"]  # REINFORCE needs no old policy
    check_against_reference(cfg, logprobs, data)


def test_everything_at_once():
    logprobs, data = make_batch(7)
    cfg = dict(ratio_clip_min=0.1, ratio_clip_max=0.3, ratio_clip_c=2.0, reference_policy_kl_penalty=0.2,
               reference_policy_kl_type="k3", kl_input_clamp_value=1.0, kl_output_clamp_value=0.5,
               use_on_policy_kl_approximation=True, use_importance_sampling_correction=True,
               truncated_importance_sampling_ratio=1.5, token_level_loss=False)
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
    "token_all": dict(ratio_clip_c=2.0, reference_policy_kl_penalty=0.2, use_on_policy_kl_approximation=True,
                      use_importance_sampling_correction=True, truncated_importance_sampling_ratio=1.5),
    "seq_all": dict(token_level_loss=False, ratio_clip_c=2.0, reference_policy_kl_penalty=0.2,
                    reference_policy_kl_type="k2", use_importance_sampling_correction=True,
                    truncated_importance_sampling_type="icepop", truncated_importance_sampling_ratio=1.4,
                    truncated_importance_sampling_ratio_min=0.7),
    "gspo_seq": dict(token_level_loss=False, sequence_level_importance_ratios=True,
                     reference_policy_kl_penalty=0.1),
    "reinforce": dict(disable_ppo_ratio=True, reference_policy_kl_penalty=0.1),
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
            metrics[k] = metrics.get(k, 0.0) + v
    return total, logprobs.grad.clone(), metrics


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
@given(perm_seed=st.integers(0, 2**16), cuts=st.lists(st.integers(1, B_INV - 1), max_size=5),
       cfg_name=st.sampled_from(["token_all", "seq_all", "gspo_seq"]))
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
        dict(use_importance_sampling_correction=True, truncated_importance_sampling_type="icepop",
             truncated_importance_sampling_ratio=2.0),  # no lower bound
        dict(use_importance_sampling_correction=True, truncated_importance_sampling_type="icepop",
             truncated_importance_sampling_ratio=0.5, truncated_importance_sampling_ratio_min=2.0),
        dict(use_importance_sampling_correction=True, truncated_importance_sampling_ratio_min=0.5),  # tis
        dict(disable_ppo_ratio=True, ratio_clip_c=3.0),
        dict(disable_ppo_ratio=True, sequence_level_importance_ratios=True),
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


def test_import_does_not_import_torch():
    code = "import sys, rlcore.algorithms.loss_functions; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


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
