"""Issue 42's smaller rows: refuse and accept where NeMo-RL does, each against an independent float64 recomputation.

- CISPO with ``force_on_policy_ratio: true`` is refused (config, loss called directly, NeMo-RL file);
- DPO with ``reference_policy_kl_penalty: 0`` is accepted, and with an SFT term it is the NLL;
- the distillation loss refuses an empty top-k, as its config does;
- REINFORCE mode reports ``probs_ratio`` with NeMo-RL's value (the token mean of log pi);
- ``calculate_baseline_and_std_per_prompt`` and ``masked_mean(dim=...)``;
- the NeMo-RL converter's ``note:`` lines.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from rlcore.algorithms.grpo.advantages import calculate_baseline_and_std_per_prompt, group_advantages
from rlcore.algorithms.grpo.loss import ClippedPGLossConfig, ClippedPGLossFn
from rlcore.algorithms.grpo.prev_logprobs import skips_prev_logprob_pass
from rlcore.algorithms.utils import masked_mean
from rlcore.config import ConfigError, load_config, resolve

GRPO = "examples/grpo_tiny.yaml"  # one optimizer step per rollout: the automatic choice would skip the pass
NEMO_GRPO = Path(__file__).parents[1] / "fixtures" / "nemo_rl" / "v0.7.0" / "grpo_math_1B.yaml"
LOCAL_DATA = [f"++data.train.data_path={Path(__file__).parents[1] / 'fixtures' / 'nemo_rl' / 'math.jsonl'}"]


def _batch(seed: int, rows: int = 6, length: int = 9) -> tuple[torch.Tensor, dict]:
    """Right-padded rows with a hole, row 1 masked out, NaN in the padding; float64 logprobs leaf."""
    rng = np.random.default_rng(seed)
    token_mask = np.zeros((rows, length))
    for b in range(rows):
        end = rng.integers(4, length + 1)
        token_mask[b, 1:end] = 1.0
        token_mask[b, rng.integers(1, end)] = 0.0
    sample_mask = np.ones(rows)
    sample_mask[1] = 0.0
    logprobs = -rng.uniform(0.2, 3.0, (rows, length))
    logprobs[token_mask == 0] = float("nan")  # padding must never count
    data = {
        "token_mask": torch.as_tensor(token_mask),
        "sample_mask": torch.as_tensor(sample_mask),
        "advantages": torch.as_tensor(rng.normal(size=(rows, length))),
        "prev_logprobs": torch.as_tensor(logprobs + rng.uniform(-0.3, 0.3, (rows, length))),
    }
    return torch.tensor(logprobs, requires_grad=True), data


def _valid(data: dict) -> list[tuple[int, int]]:
    """(row, position) of every token that counts: token_mask and sample_mask set, position >= 1."""
    tm, sm = data["token_mask"].numpy(), data["sample_mask"].numpy()
    return [(b, t) for b in range(tm.shape[0]) for t in range(1, tm.shape[1]) if tm[b, t] and sm[b]]


# -- CISPO with a forced on-policy ratio --------------------------------------------------------------------------


CISPO_FORCED = (
    "use_cispo=true cannot be combined with force_on_policy_ratio=true: a forced ratio of 1 removes "
    "the clipped weight CISPO trains with; set force_on_policy_ratio to null or false"
)


def test_cispo_with_a_forced_ratio_is_one_line_naming_both_keys_and_the_fix():
    with pytest.raises(ConfigError) as info:
        load_config(GRPO, ["loss.use_cispo=true", "loss.force_on_policy_ratio=true"])
    assert info.value.problems == [f"loss: {CISPO_FORCED}"]


def test_the_loss_called_directly_refuses_it_too():
    with pytest.raises(ConfigError) as info:
        ClippedPGLossFn({"use_cispo": True, "force_on_policy_ratio": True})
    assert info.value.problems == [f"loss: {CISPO_FORCED}"]
    with pytest.raises(ValidationError, match="force_on_policy_ratio to null or false"):
        ClippedPGLossConfig(use_cispo=True, force_on_policy_ratio=True)


@pytest.mark.parametrize("value, skips", [(None, False), (False, False)])
def test_cispo_with_an_automatic_or_no_forced_ratio_runs_the_prev_logprob_pass(value, skips):
    """null no longer turns the forced ratio on for CISPO: the pass runs, as in NeMo-RL."""
    setting = "null" if value is None else "false"
    cfg = load_config(GRPO, ["loss.use_cispo=true", f"loss.force_on_policy_ratio={setting}"])
    assert skips_prev_logprob_pass(cfg) is skips
    assert resolve(cfg, run=True).config.loss.force_on_policy_ratio is skips
    assert skips_prev_logprob_pass(load_config(GRPO))  # without CISPO the automatic choice still skips it


def test_a_nemo_rl_cispo_config_with_a_forced_ratio_is_refused():
    from rlcore.nemo_rl import load_nemo_rl_config

    with pytest.raises(ConfigError) as info:
        load_nemo_rl_config(NEMO_GRPO, [*LOCAL_DATA, "loss_fn.use_cispo=true", "loss_fn.force_on_policy_ratio=true"])
    assert any(CISPO_FORCED in line for line in info.value.problems), info.value.problems


# -- DPO with beta = 0 ----------------------------------------------------------------------------------------


def test_dpo_accepts_a_zero_kl_penalty():
    cfg = load_config("examples/dpo_tiny.yaml", ["dpo.reference_policy_kl_penalty=0"])
    assert cfg.dpo.reference_policy_kl_penalty == 0.0
    with pytest.raises(ConfigError):
        load_config("examples/dpo_tiny.yaml", ["dpo.reference_policy_kl_penalty=-0.1"])


def _dpo_batch(seed: int) -> tuple[torch.Tensor, dict]:
    """3 (chosen, rejected) pairs, the last one masked out; float64 logprobs leaf."""
    logprobs, data = _batch(seed, rows=6)
    data["sample_mask"] = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 0.0])
    rng = np.random.default_rng(seed + 100)
    data["reference_policy_logprobs"] = torch.as_tensor(-rng.uniform(0.2, 3.0, logprobs.shape))
    return logprobs, data


@pytest.mark.parametrize("average", [False, True])
def test_dpo_with_zero_beta_and_only_the_sft_term_is_the_nll_of_the_chosen_responses(average):
    from rlcore.algorithms.dpo.loss import DPOLossFn

    logprobs, data = _dpo_batch(1)
    loss_fn = DPOLossFn(
        {
            "reference_policy_kl_penalty": 0.0,
            "preference_loss_weight": 0.0,
            "sft_loss_weight": 1.0,
            "sft_average_log_probs": average,
        }
    )
    loss, metrics = loss_fn(logprobs, data, data["sample_mask"].sum(), None)
    (grad,) = torch.autograd.grad(loss, logprobs)

    # float64, token by token: per valid chosen row, -sum (or mean) of its logprobs; a mean over the valid pairs
    lp, valid = logprobs.detach().numpy(), _valid(data)
    chosen = sorted({b for b, _ in valid if b % 2 == 0})
    expected_grad = np.zeros(lp.shape)
    per_pair = []
    for b in chosen:
        tokens = [t for row, t in valid if row == b]
        scale = 1.0 / len(tokens) if average else 1.0
        per_pair.append(-scale * math.fsum(lp[b, t] for t in tokens))
        for t in tokens:
            expected_grad[b, t] = -scale / len(chosen)
    expected = math.fsum(per_pair) / len(chosen)
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert metrics["sft_loss"] == pytest.approx(expected, rel=1e-12)
    np.testing.assert_allclose(grad.numpy(), expected_grad, rtol=1e-12, atol=1e-15)

    if not average:  # NeMo-RL's check: rescaled to a mean over the chosen tokens, it is NLLLoss on the chosen rows
        from rlcore.algorithms.loss_functions import NLLLoss

        chosen_data = {key: data[key][0::2] for key in ("token_mask", "sample_mask")}
        tokens = sum(1 for b, _ in valid if b % 2 == 0)
        nll, _ = NLLLoss()(logprobs[0::2], chosen_data, None, tokens)
        assert (loss * len(chosen) / tokens).item() == pytest.approx(nll.item(), rel=1e-12)


def test_dpo_with_zero_beta_keeps_a_constant_preference_term_without_gradient():
    from rlcore.algorithms.dpo.loss import DPOLossFn

    logprobs, data = _dpo_batch(2)
    sft_only = DPOLossFn({"reference_policy_kl_penalty": 0.0, "preference_loss_weight": 0.0, "sft_loss_weight": 0.5})
    both = DPOLossFn({"reference_policy_kl_penalty": 0.0, "preference_loss_weight": 1.0, "sft_loss_weight": 0.5})
    loss_sft, _ = sft_only(logprobs, data, data["sample_mask"].sum(), None)
    loss_both, metrics = both(logprobs, data, data["sample_mask"].sum(), None)
    assert metrics["preference_loss"] == pytest.approx(math.log(2.0), rel=1e-12)  # -log sigmoid(0)
    assert loss_both.item() == pytest.approx(loss_sft.item() + math.log(2.0), rel=1e-12)
    (g_sft,) = torch.autograd.grad(loss_sft, logprobs)
    (g_both,) = torch.autograd.grad(loss_both, logprobs)
    torch.testing.assert_close(g_both, g_sft, rtol=0, atol=1e-15)


# -- distillation with an empty top-k -----------------------------------------------------------------------------


def test_the_distillation_loss_refuses_an_empty_top_k_as_its_config_does():
    from rlcore.algorithms.distillation import DistillationLossFn
    from rlcore.algorithms.distillation.loss import TEACHER_LOGITS_KEY
    from rlcore.interfaces.loss import LOGITS_AT_INDICES

    with pytest.raises(ConfigError) as info:
        load_config("examples/distill_tiny.yaml", ["distillation.topk_logits_k=0"])
    assert info.value.problems == ["distillation.topk_logits_k: expected a value > 0, got 0"]

    logprobs, data = _batch(3)
    for k, ok in ((0, False), (1, True)):
        inputs = dict(
            data,
            **{LOGITS_AT_INDICES: torch.zeros(*logprobs.shape, k), TEACHER_LOGITS_KEY: torch.zeros(*logprobs.shape, k)},
        )
        if ok:
            loss, _ = DistillationLossFn()(logprobs, inputs, 5, 10)
            assert loss.item() == 0.0  # one id: both distributions are certain, KL 0
        else:
            with pytest.raises(ValueError, match=r"empty top-k \(k = 0\).*distillation.topk_logits_k"):
                DistillationLossFn()(logprobs, inputs, 5, 10)


# -- probs_ratio in REINFORCE mode ------------------------------------------------------------------------------


@pytest.mark.parametrize("force", [False, True])
def test_reinforce_reports_probs_ratio_as_nemo_rl_does(force):
    """NeMo-RL's ClippedPGLossFn sets ratios = curr_logprobs without a ratio (1 when forced)."""
    logprobs, data = _batch(4)
    del data["prev_logprobs"]
    global_tokens = 40.0  # a bigger step than this micro-batch: its share of the mean
    cfg = {"disable_ppo_ratio": True, "force_on_policy_ratio": force}
    _, metrics = ClippedPGLossFn(cfg)(logprobs, data, 5, global_tokens)
    values = [1.0 if force else float(logprobs.detach()[b, t]) for b, t in _valid(data)]
    for name in ("probs_ratio", "probs_ratio_clamped"):
        assert metrics[name] == pytest.approx(math.fsum(values) / global_tokens, rel=1e-12)
        assert (metrics[f"{name}_min"], metrics[f"{name}_max"]) == (min(values), max(values))
    assert "clip_fraction" not in metrics  # rlcore's own metric: nothing is clipped without a ratio


# -- calculate_baseline_and_std_per_prompt ---------------------------------------------------------------------


def _baseline_reference(prompts, rewards, valid, leave_one_out, std_rewards=None):
    """float64, sample by sample, from the definition: the others (or all) valid samples of the same prompt."""
    std_rewards = rewards if std_rewards is None else std_rewards
    baselines, stds = [], []
    for i in range(len(rewards)):
        group = [j for j in range(len(rewards)) if prompts[j] == prompts[i]]
        if sum(valid[j] for j in group) <= 1:
            baselines.append(float(rewards[i]))
            stds.append(0.0)
            continue
        counted = [j for j in group if valid[j] and not (leave_one_out and j == i)]
        n = sum(valid[j] for j in group) - int(leave_one_out)  # NeMo-RL's count (an invalid i is not among them)
        baselines.append(math.fsum(float(rewards[j]) for j in counted) / n)
        if n <= 1:
            stds.append(0.0)
            continue
        mean = math.fsum(float(std_rewards[j]) for j in counted) / n
        variance = math.fsum(float(std_rewards[j]) ** 2 for j in counted) / n - mean * mean
        stds.append(math.sqrt(max(variance * n / (n - 1), 0.0)))
    return np.array(baselines), np.array(stds)


@pytest.mark.parametrize("leave_one_out", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_baseline_and_std_per_prompt_against_a_float64_recomputation(leave_one_out, seed):
    rng = np.random.default_rng(seed)
    rows = 14
    prompt_ids = rng.integers(0, 4, rows)  # identical prompts anywhere in the batch, not in consecutive runs
    prompts = torch.as_tensor(np.stack([prompt_ids, 7 * prompt_ids + 1], axis=1))
    rewards = torch.as_tensor(rng.normal(size=rows))
    valid = torch.as_tensor((rng.uniform(size=rows) > 0.25).astype(np.float64))
    std_rewards = torch.as_tensor(rng.normal(size=rows)) if seed % 2 else None
    baseline, std = calculate_baseline_and_std_per_prompt(prompts, rewards, valid, leave_one_out, std_rewards)
    assert baseline.dtype == std.dtype == rewards.dtype and baseline.shape == std.shape == (rows,)
    ref_baseline, ref_std = _baseline_reference(
        prompt_ids, rewards.numpy(), valid.numpy(), leave_one_out, None if std_rewards is None else std_rewards.numpy()
    )
    np.testing.assert_allclose(baseline.numpy(), ref_baseline, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(std.numpy(), ref_std, rtol=1e-10, atol=1e-12)


def test_leave_one_out_by_hand_and_a_prompt_with_one_valid_sample():
    prompts = torch.tensor([[5], [9], [5], [9], [5], [3], [3]])
    rewards = torch.tensor([1.0, 2.0, 3.0, 4.0, 8.0, 6.0, 7.0])
    valid = torch.tensor([1, 1, 1, 1, 1, 1, 0])
    baseline, std = calculate_baseline_and_std_per_prompt(prompts, rewards, valid)
    # prompt 5: the others' means (3+8)/2, (1+8)/2, (1+3)/2 and their unbiased stds; prompt 9: one other each
    torch.testing.assert_close(baseline, torch.tensor([5.5, 4.0, 4.5, 2.0, 2.0, 6.0, 7.0]))
    torch.testing.assert_close(
        std, torch.tensor([math.sqrt(12.5), 0.0, math.sqrt(24.5), 0.0, math.sqrt(2.0), 0.0, 0.0])
    )
    # prompt 3 has one valid sample: baseline = own reward (advantage 0), std 0
    baseline, std = calculate_baseline_and_std_per_prompt(prompts, rewards, valid, leave_one_out_baseline=False)
    torch.testing.assert_close(baseline[[0, 2, 4]], torch.full((3,), 4.0))
    torch.testing.assert_close(std[[0, 2, 4]], torch.full((3,), math.sqrt(13.0)))


@pytest.mark.parametrize("estimator, leave_one_out", [("leave_one_out_std", True), ("mean_std", False)])
def test_group_advantages_are_this_baseline_and_std_for_consecutive_groups(estimator, leave_one_out):
    """NeMo-RL's GRPO advantage: (r - baseline) / (std + 1e-6) where std > 0, else r - baseline."""
    rng = np.random.default_rng(7)
    rewards = torch.as_tensor(rng.integers(0, 3, 12).astype(np.float64))
    prompts = torch.arange(3).repeat_interleave(4)[:, None]
    baseline, std = calculate_baseline_and_std_per_prompt(prompts, rewards, torch.ones(12), leave_one_out)
    expected = torch.where(std > 0, (rewards - baseline) / (std + 1e-6), rewards - baseline)
    torch.testing.assert_close(group_advantages(rewards, 4, estimator).double(), expected, rtol=1e-6, atol=1e-6)


# -- masked_mean ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dim", [None, 0, 1, -1])
def test_masked_mean_with_dim_against_a_float64_recomputation(dim):
    rng = np.random.default_rng(11)
    values = rng.normal(size=(4, 5))
    mask = (rng.uniform(size=(4, 5)) > 0.4).astype(np.float64)
    mask[2] = 0.0  # a row with nothing: its mean is 0
    values[mask == 0] = np.nan  # never read
    got = masked_mean(torch.as_tensor(values), torch.as_tensor(mask), dim=dim).numpy()
    axis = None if dim is None else dim % 2

    def mean(v, m):
        kept = [x for x, keep in zip(v, m) if keep]
        return math.fsum(kept) / len(kept) if kept else 0.0

    if axis is None:
        expected = mean(values.ravel(), mask.ravel())
    elif axis == 0:
        expected = [mean(values[:, j], mask[:, j]) for j in range(5)]
    else:
        expected = [mean(values[i], mask[i]) for i in range(4)]
    np.testing.assert_allclose(got, expected, rtol=1e-14, atol=0)


def test_masked_mean_with_a_global_normalization_factor_is_this_micro_batchs_share():
    values, mask = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]), torch.tensor([[1, 0, 1], [1, 1, 0]])
    assert masked_mean(values, mask, global_normalization_factor=10).item() == pytest.approx(13.0 / 10)
    torch.testing.assert_close(
        masked_mean(values, mask, dim=-1, global_normalization_factor=4.0), torch.tensor([1.0, 2.25])
    )


# -- the converter's note lines -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, starts",
    [
        (["loss_fn.positive_example_nll_weight=0.5"], "note: loss_fn.positive_example_nll_weight: "),
        (
            [
                "loss_fn.disable_ppo_ratio=true",
                "loss_fn.force_on_policy_ratio=true",
                "grpo.num_prompts_per_step=32",
                "policy.train_global_batch_size=512",
            ],
            "note: loss_fn.force_on_policy_ratio with disable_ppo_ratio: ",
        ),
    ],
)
def test_a_deliberate_difference_gets_one_note_line(overrides, starts):
    from rlcore.nemo_rl import load_nemo_rl_config

    lines = load_nemo_rl_config(NEMO_GRPO, [*LOCAL_DATA, *overrides]).ignored_lines()
    notes = [line for line in lines if line.startswith("note: ")]
    assert len(notes) == 1 and notes[0].startswith(starts) and notes[0].endswith("(docs/nemo-rl-semantics.md)")
    assert lines[-1] == notes[0]  # after the ignored keys
    plain = load_nemo_rl_config(NEMO_GRPO, LOCAL_DATA).ignored_lines()
    assert not [line for line in plain if line.startswith("note: ")]  # the stock file differs nowhere on purpose
