"""Run NeMo-RL's own ClippedPGLossFn and BatchedDataDict.reorder_data beside rlcore's on identical CPU
inputs (48 loss configurations x 3 seeds): loss, gradient and every shared metric.

Not a test: it needs NeMo-RL's source, which CI does not have. With a NeMo-RL checkout's ``nemo_rl``
package extracted into NEMO (e.g. ``git -C RL archive v0.7.0 nemo_rl | tar -x -C NEMO``)::

    PYTHONPATH=src:NEMO python scripts/nemo_rl_parity.py

NeMo-RL modules whose imports need packages this venv lacks (hydra, pynvml, mlflow) are stubbed; none of
what they define is used by the code compared. docs/nemo-rl-semantics.md has the results and reasons.
"""

import math
import sys
import types

import torch

torch.set_default_dtype(torch.float64)

# ---------------------------------------------------------------------------
# Stubs: only the nemo_rl modules whose import fails in this venv (missing
# hydra / pynvml / mlflow further down their import chains). None of the
# stubbed names is used by ClippedPGLossFn.__call__, calculate_kl or
# masked_mean; they are only imported at module top level.
# ---------------------------------------------------------------------------
STUBBED = {}


def _dummy(name):
    def f(*a, **k):
        raise RuntimeError(f"stub {name} called")

    f.__name__ = name
    return f


def stub(modname, names, classes=()):
    m = types.ModuleType(modname)
    m.__dict__["__stub__"] = True
    for n in names:
        setattr(m, n, _dummy(n))
    for n in classes:
        setattr(m, n, type(n, (), {}))
    sys.modules[modname] = m
    STUBBED[modname] = list(names) + list(classes)


# loss_functions.py -> x_token/loss_utils.py -> models/dtensor/parallelize.py -> hydra (missing)
stub(
    "nemo_rl.algorithms.x_token.loss_utils",
    [
        "build_exact_token_map",
        "ce_label_mask",
        "chunk_average_log_probs",
        "get_sparse_projection_matrix",
        "next_token_accuracy",
        "project_student_to_teacher_vocab",
        "select_teacher_topk_indices",
        "student_next_token_ce",
        "valid_chunk_mask",
        # imported by nemo_rl/algorithms/loss/utils.py (pulled in by loss/__init__.py)
        "prepare_xtoken_cross_tokenizer_loss_input",
    ],
    classes=["LocalizedAlignment"],
)
# loss_functions.py -> models/dtensor/parallelize.py -> hydra (missing)
stub("nemo_rl.models.dtensor.parallelize", ["to_local_if_dtensor"])
# algorithms/utils.py -> models/policy/__init__ -> models/generation/vllm -> utils/nvml -> pynvml (missing)
stub("nemo_rl.models.policy", [], classes=["TokenizerConfig"])
# algorithms/utils.py -> utils/logger.py -> mlflow (missing)
stub("nemo_rl.utils.logger", [], classes=["Logger"])

import nemo_rl.algorithms.utils as nemo_utils  # noqa: E402  (real calculate_kl / masked_mean)
from nemo_rl.algorithms.loss.loss_functions import ClippedPGLossConfig as NCfg  # noqa: E402
from nemo_rl.algorithms.loss.loss_functions import ClippedPGLossFn as NFn  # noqa: E402
from nemo_rl.distributed.batched_data_dict import BatchedDataDict as NBDD  # noqa: E402

import rlcore.algorithms.loss_functions as rl_lf  # noqa: E402
from rlcore.data import BatchedDataDict as RBDD  # noqa: E402

assert not getattr(nemo_utils, "__stub__", False)
assert nemo_utils.calculate_kl.__module__ == "nemo_rl.algorithms.utils"

# NeMo-only keys dropped for rlcore
NEMO_ONLY = {"use_kl_in_reward", "positive_example_nll_weight"}

B, S = 8, 16


def make_inputs(seed):
    g = torch.Generator().manual_seed(seed)

    def U(lo, hi, shape):
        return lo + (hi - lo) * torch.rand(shape, generator=g)

    token_mask = torch.zeros(B, S)
    for b in range(B):
        p = int(torch.randint(2, 6, (1,), generator=g))  # prompt length (position 0 is prompt)
        r = int(torch.randint(1, S - p + 1, (1,), generator=g))  # response length >= 1
        token_mask[b, p : p + r] = 1.0  # right padding after p+r
    sample_mask = torch.ones(B)
    sample_mask[3] = 0.0
    lp = -U(0.5, 3.0, (B, S - 1))  # next-token logprobs aligned with [:, 1:]
    prev = lp + U(-0.5, 0.5, (B, S - 1))
    gen = prev + U(-0.7, 0.7, (B, S - 1))
    ref = lp + U(-1.5, 1.5, (B, S - 1))
    adv = torch.randn(B, S, generator=g)

    def full(x):  # [B, S-1] -> [B, S] with a junk position 0
        return torch.cat([torch.zeros(B, 1), x], 1)

    data = {
        "token_mask": token_mask,
        "sample_mask": sample_mask,
        "advantages": adv,
        "prev_logprobs": full(prev),
        "generation_logprobs": full(gen),
        "reference_policy_logprobs": full(ref),
        "input_ids": torch.zeros(B, S, dtype=torch.long),
    }
    gvt = (token_mask[:, 1:] * sample_mask[:, None]).sum()
    gvs = sample_mask.sum()
    return lp, data, gvs, gvt


def configs():
    out = []

    def add(name, cfg, levels=(True, False)):
        for tl in levels:
            c = dict(cfg)
            c["token_level_loss"] = tl
            out.append((f"{name}[{'tok' if tl else 'seq'}]", c))

    nokl = {"reference_policy_kl_penalty": 0.0}
    add("ppo", nokl)
    add("dapo(0.2,0.28)", {**nokl, "ratio_clip_min": 0.2, "ratio_clip_max": 0.28})
    add("dual_clip c=3", {**nokl, "ratio_clip_c": 3.0})
    add("dual_clip c=1.2 (extra, binds)", {**nokl, "ratio_clip_c": 1.2})
    for kt in ("k1", "k2", "k3"):
        for cname, (ci, co) in (("default", (20.0, 10.0)), ("tight", (0.5, 0.2))):
            for onp in (False, True):
                add(
                    f"kl {kt} {cname}{' onpolicy' if onp else ''}",
                    {
                        "reference_policy_kl_penalty": 0.1,
                        "reference_policy_kl_type": kt,
                        "kl_input_clamp_value": ci,
                        "kl_output_clamp_value": co,
                        "use_on_policy_kl_approximation": onp,
                    },
                )
    isc = {**nokl, "use_importance_sampling_correction": True}
    add("is (no trunc)", isc)
    add("is tis 1.5", {**isc, "truncated_importance_sampling_type": "tis", "truncated_importance_sampling_ratio": 1.5})
    add(
        "is tis [0.8,1.5]",
        {
            **isc,
            "truncated_importance_sampling_type": "tis",
            "truncated_importance_sampling_ratio": 1.5,
            "truncated_importance_sampling_ratio_min": 0.8,
        },
    )
    add(
        "is icepop [0.5,2]",
        {
            **isc,
            "truncated_importance_sampling_type": "icepop",
            "truncated_importance_sampling_ratio": 2.0,
            "truncated_importance_sampling_ratio_min": 0.5,
        },
    )
    add(
        "is seq-mask-tis [0.95,1.05]",
        {
            **isc,
            "truncated_importance_sampling_type": "seq-mask-tis",
            "truncated_importance_sampling_ratio": 1.05,
            "truncated_importance_sampling_ratio_min": 0.95,
        },
    )
    gspo = {**nokl, "sequence_level_importance_ratios": True}
    add("gspo", gspo, levels=(False,))
    add("gspo + is", {**gspo, "use_importance_sampling_correction": True}, levels=(False,))
    add(
        "gspo + is tis 1.5",
        {
            **gspo,
            "use_importance_sampling_correction": True,
            "truncated_importance_sampling_type": "tis",
            "truncated_importance_sampling_ratio": 1.5,
        },
        levels=(False,),
    )
    add("cispo + is", {**isc, "use_cispo": True}, levels=(True,))
    add("reinforce beta=0.05", {"disable_ppo_ratio": True, "reference_policy_kl_penalty": 0.05})
    return out


def run_nemo(cfg, lp0, data, gvs, gvt):
    lp = lp0.detach().clone().requires_grad_(True)
    fn = NFn(NCfg(**cfg))
    loss, metrics = fn(lp, NBDD(data), gvs, gvt)
    loss.backward()
    return float(loss), lp.grad.clone(), {k: float(v) for k, v in metrics.items()}


def run_rlcore(cfg, lp0, data, gvs, gvt):
    c = {k: v for k, v in cfg.items() if k not in NEMO_ONLY}
    lp = lp0.detach().clone().requires_grad_(True)
    full = torch.cat([torch.zeros(B, 1), lp], 1)
    fn = rl_lf.ClippedPGLossFn(c)
    loss, metrics = fn(full, dict(data), gvs, gvt)
    loss.backward()
    return float(loss), lp.grad.clone(), {k: float(v) for k, v in metrics.items()}


def adiff(a, b):
    if math.isinf(a) or math.isinf(b) or math.isnan(a) or math.isnan(b):
        return 0.0 if (a == b or (math.isnan(a) and math.isnan(b))) else float("inf")
    return abs(a - b)


def main(label="MAIN RUN (NeMo-RL code unmodified)"):
    print(f"######## {label} ########")
    seeds = [0, 1, 2]
    inputs = [make_inputs(s) for s in seeds]
    print("stubbed modules:", STUBBED)
    print(f"seeds={seeds}; values below are max over seeds; FLAG = > 1e-9\n")
    summary = []
    for name, cfg in configs():
        errs = []
        worst = {"loss": 0.0, "grad": 0.0}
        mdiff = {}
        only_n, only_r = set(), set()
        for s, (lp, data, gvs, gvt) in zip(seeds, inputs):
            try:
                ln, gn, mn = run_nemo(cfg, lp, data, gvs, gvt)
            except Exception as e:
                errs.append(f"seed{s} NeMo raised {type(e).__name__}: {e}")
                continue
            try:
                lr, gr, mr = run_rlcore(cfg, lp, data, gvs, gvt)
            except Exception as e:
                errs.append(f"seed{s} rlcore raised {type(e).__name__}: {e}")
                continue
            worst["loss"] = max(worst["loss"], abs(ln - lr))
            worst["grad"] = max(worst["grad"], float((gn - gr).abs().max()))
            for k in set(mn) & set(mr):
                d = adiff(mn[k], mr[k])
                if d > mdiff.get(k, (-1,))[0]:
                    mdiff[k] = (d, mn[k], mr[k])
            only_n |= set(mn) - set(mr)
            only_r |= set(mr) - set(mn)
        print(f"=== {name}  cfg={cfg}")
        for e in errs:
            print("   ERROR:", e)
        flag = lambda d: "  <-- FLAG" if d > 1e-9 else ""  # noqa: E731
        print(f"   |loss diff| = {worst['loss']:.3e}{flag(worst['loss'])}")
        print(f"   max|grad diff| = {worst['grad']:.3e}{flag(worst['grad'])}")
        for k in sorted(mdiff):
            d, a, b = mdiff[k]
            print(f"   metric {k:28s} {d:.3e}{flag(d)}" + (f"   (nemo={a:.6g} rlcore={b:.6g})" if d > 1e-9 else ""))
        print(f"   only in NeMo:   {sorted(only_n)}")
        print(f"   only in rlcore: {sorted(only_r)}")
        flagged = [k for k, v in mdiff.items() if v[0] > 1e-9]
        summary.append(
            (name, worst["loss"], worst["grad"], max([v[0] for v in mdiff.values()] or [0.0]), flagged, errs)
        )
        print()

    print("\n===== SUMMARY (max over seeds) =====")
    print(f"{'config':44s} {'|dloss|':>10s} {'|dgrad|':>10s} {'max|dmetric|':>13s}  flagged metrics / errors")
    for name, dl, dg, dm, fl, errs in summary:
        print(
            f"{name:44s} {dl:10.2e} {dg:10.2e} {dm:13.2e}  {','.join(fl)} {'ERR: ' + ' | '.join(errs) if errs else ''}"
        )


def gspo_sir_check():
    """NeMo's GSPO sampling_importance_ratio: masked_mean([B,1] weights, [B] sample_mask) broadcasts to [B,B]."""
    print("\n===== GSPO sampling_importance_ratio hand check (seed 0) =====")
    lp, data, gvs, gvt = make_inputs(0)
    tm, sm = data["token_mask"][:, 1:], data["sample_mask"]
    mask = tm * sm[:, None]
    w = torch.exp(((data["prev_logprobs"][:, 1:] - data["generation_logprobs"][:, 1:]) * mask).sum(-1))
    _, _, mn = run_nemo(
        {"reference_policy_kl_penalty": 0.0, "sequence_level_importance_ratios": True, "token_level_loss": False},
        lp,
        data,
        gvs,
        gvt,
    )
    _, _, mr = run_rlcore(
        {"reference_policy_kl_penalty": 0.0, "sequence_level_importance_ratios": True, "token_level_loss": False},
        lp,
        data,
        gvs,
        gvt,
    )
    print(f"NeMo  metric = {mn['sampling_importance_ratio']:.10f}")
    print(
        f"sum over ALL rows of w_i (incl. sample_mask=0 row) * sum(sample_mask)/(gvs+1e-8) = "
        f"{float(w.sum() * sm.sum() / (gvs + 1e-8)):.10f}"
    )
    print(f"rlcore metric = {mr['sampling_importance_ratio']:.10f}")
    print(f"mean of w_i over sample_mask rows = {float((w * sm).sum() / gvs):.10f}")


def reorder_check():
    # ------------------------------------------------------------------ reorder_data
    print("\n===== reorder_data =====")
    n = NBDD({"x": torch.tensor([10, 11, 12]), "l": ["a", "b", "c"]})
    r = RBDD({"x": torch.tensor([10, 11, 12]), "l": ["a", "b", "c"]})
    rn = n.reorder_data([2, 0, 1])
    rr = r.reorder_data([2, 0, 1])
    print("NeMo   x =", n["x"].tolist(), "l =", list(n["l"]), "return =", rn)
    print("rlcore x =", r["x"].tolist(), "l =", list(r["l"]), "return =", rr)
    print("match:", n["x"].tolist() == r["x"].tolist() and list(n["l"]) == list(r["l"]))
    g = torch.Generator().manual_seed(0)
    ok = True
    for _ in range(50):
        m = int(torch.randint(1, 12, (1,), generator=g))
        perm = torch.randperm(m, generator=g).tolist()
        n = NBDD({"x": torch.arange(m) * 10, "y": torch.randn(m, 3, generator=g)})
        r = RBDD({"x": n["x"].clone(), "y": n["y"].clone()})
        n.reorder_data(perm)
        r.reorder_data(perm)
        ok &= torch.equal(n["x"], r["x"]) and torch.equal(n["y"], r["y"])
    print("50 random permutations (sizes 1..11, tensor [m] and [m,3]) all match:", ok)


if __name__ == "__main__":
    main()
    gspo_sir_check()
    reorder_check()
    # Diagnostic: NeMo's masked_mean divides by (normaliser + 1e-8); rlcore divides by the exact
    # normaliser. Re-run with that epsilon removed (in-memory patch of the name bound in
    # loss_functions only) to show the remaining diffs are that epsilon.
    import nemo_rl.algorithms.loss.loss_functions as nlf

    def masked_mean_no_eps(values, mask, dim=None, global_normalization_factor=None):
        n = torch.sum(mask, dim=dim) if global_normalization_factor is None else global_normalization_factor
        return torch.sum(values * mask, dim=dim) / n

    nlf.masked_mean = masked_mean_no_eps
    print("\n\n")
    main("DIAGNOSTIC RUN: NeMo masked_mean WITHOUT its +1e-8 epsilon (in-memory patch)")
