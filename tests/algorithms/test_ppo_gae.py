"""PPO's GAE (rlcore.algorithms.ppo.gae) against an independent float64 recomputation: plain Python loops over
each row's generated tokens, advantages as the explicit sum over future TD errors (not the backward recursion the
code runs), whitening with the statistics module."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from rlcore.algorithms.grpo.loss_config import ClippedPGLossConfig
from rlcore.algorithms.ppo.config import GAEConfig
from rlcore.algorithms.ppo.gae import batch_advantages, generalized_advantages, policy_lambda, ppo_advantages, whiten

B, S = 4, 14


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token rewards, values and a mask with a prompt, a multi-turn hole, different lengths, and an empty row."""
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(B, S, generator=g)
    values = torch.randn(B, S, generator=g)
    mask = torch.zeros(B, S, dtype=torch.bool)
    mask[0, 3:14] = True  # one turn to the end of the row
    mask[1, 2:5] = True  # two turns around an environment observation at 5..7, then padding
    mask[1, 8:11] = True
    mask[2, 5:7] = True  # short, then padding
    # row 3: no generated token (a sample_mask 0 row)
    return rewards, values, mask


def reference_gae(rewards: list[float], values: list[float], valid: list[bool], gamma: float, lam: float):
    """Advantages and returns of one row: A_t = sum_k (gamma * lam)^k delta_{t+k} over the generated tokens only."""
    steps = [i for i, ok in enumerate(valid) if ok]
    deltas = []
    for j, pos in enumerate(steps):
        next_value = values[steps[j + 1]] if j + 1 < len(steps) else 0.0
        deltas.append(rewards[pos] + gamma * next_value - values[pos])
    adv, ret = [0.0] * len(valid), [0.0] * len(valid)
    for j, pos in enumerate(steps):
        adv[pos] = sum((gamma * lam) ** k * deltas[j + k] for k in range(len(steps) - j))
        ret[pos] = adv[pos] + values[pos]
    return adv, ret


def reference_batch(rewards, values, mask, gamma, lams):
    advs, rets = [], []
    for b in range(rewards.shape[0]):
        a, r = reference_gae(
            rewards[b].double().tolist(), values[b].double().tolist(), mask[b].tolist(), gamma, float(lams[b])
        )
        advs.append(a)
        rets.append(r)
    return torch.tensor(advs, dtype=torch.float64), torch.tensor(rets, dtype=torch.float64)


def reference_whiten(adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    kept = [float(a) for a, m in zip(adv.flatten().tolist(), mask.flatten().tolist()) if m]
    mean, var = statistics.fmean(kept), statistics.variance(kept)
    out = [
        [(float(a) - mean) / (var + 1e-8) ** 0.5 if m else 0.0 for a, m in zip(ra, rm)]
        for ra, rm in zip(adv.tolist(), mask.tolist())
    ]
    return torch.tensor(out, dtype=torch.float64)


def close(got: torch.Tensor, expected: torch.Tensor, atol: float = 1e-5) -> None:
    assert got.shape == expected.shape
    assert torch.allclose(got.double(), expected, atol=atol, rtol=1e-5), (got - expected).abs().max()


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.95), (1.0, 0.0), (0.97, 0.6)])
def test_gae_gamma_and_lambda_against_float64_sum_of_td_errors(gamma, lam):
    rewards, values, mask = batch()
    cfg = GAEConfig(gae_gamma=gamma, gae_lambda=lam, normalize_advantages=False)
    out = ppo_advantages(cfg, rewards, values, mask)
    adv, ret = reference_batch(rewards, values, mask, gamma, [lam] * B)
    assert out.advantages.dtype == torch.float32 and out.returns.dtype == torch.float32
    close(out.advantages, adv)
    close(out.returns, ret)
    assert not out.advantages[~mask].any() and not out.returns[~mask].any()


def test_lambda_and_gamma_one_is_the_reward_to_go():
    rewards, values, mask = batch(1)
    out = ppo_advantages(GAEConfig(gae_gamma=1.0, gae_lambda=1.0, normalize_advantages=False), rewards, values, mask)
    for b in range(B):
        steps = [i for i in range(S) if mask[b, i]]
        for j, pos in enumerate(steps):
            to_go = sum(float(rewards[b, p]) for p in steps[j:])
            assert out.returns[b, pos].item() == pytest.approx(to_go, abs=1e-5)


def test_a_masked_span_is_skipped_as_if_it_were_not_there():
    """Row 1 has an environment observation between its turns: what is written there is never read, and the
    result equals GAE on the row with the span cut out (NeMo-RL's carry-forward masking)."""
    rewards, values, mask = batch(2)
    out = generalized_advantages(rewards, values, mask, 0.9, 0.8)
    noisy_r, noisy_v = rewards.clone(), values.clone()
    noisy_r[~mask], noisy_v[~mask] = 1e3, -1e3
    assert torch.equal(generalized_advantages(noisy_r, noisy_v, mask, 0.9, 0.8), out)
    kept = mask[1].nonzero().flatten()
    cut = generalized_advantages(
        rewards[1:2, kept], values[1:2, kept], torch.ones(1, len(kept), dtype=torch.bool), 0.9, 0.8
    )
    assert torch.allclose(out[1, kept], cut[0])


def test_decoupled_lambda_value_and_lambda_policy():
    rewards, values, mask = batch(3)
    cfg = GAEConfig(gae_lambda=0.95, gae_lambda_value=1.0, gae_lambda_policy=0.5, normalize_advantages=False)
    out = ppo_advantages(cfg, rewards, values, mask)
    _, ret = reference_batch(rewards, values, mask, 1.0, [1.0] * B)
    adv, _ = reference_batch(rewards, values, mask, 1.0, [0.5] * B)
    close(out.returns, ret)
    close(out.advantages, adv)
    # lambda_value alone: the policy keeps gae_lambda
    out = ppo_advantages(
        GAEConfig(gae_lambda=0.7, gae_lambda_value=1.0, normalize_advantages=False), rewards, values, mask
    )
    close(out.advantages, reference_batch(rewards, values, mask, 1.0, [0.7] * B)[0])
    close(out.returns, ret)


def test_length_adaptive_lambda_policy_per_sequence():
    rewards, values, mask = batch(4)
    alpha = 0.25
    cfg = GAEConfig(gae_lambda=0.95, gae_lambda_value=1.0, length_adaptive_alpha=alpha, normalize_advantages=False)
    lengths = [sum(mask[b].tolist()) for b in range(B)]  # 11, 6, 2, 0
    expected_lams = [min(1.0, max(0.0, 1.0 - 1.0 / max(alpha * n, 1.0))) for n in lengths]
    assert expected_lams[0] == pytest.approx(1 - 1 / 2.75) and expected_lams[2] == 0.0
    got_lams = policy_lambda(cfg, mask)
    assert torch.allclose(got_lams, torch.tensor(expected_lams, dtype=torch.float64))
    out = ppo_advantages(cfg, rewards, values, mask)
    close(out.advantages, reference_batch(rewards, values, mask, 1.0, expected_lams)[0])
    close(out.returns, reference_batch(rewards, values, mask, 1.0, [1.0] * B)[1])


def test_normalize_advantages_whitens_over_the_batch_tokens():
    rewards, values, mask = batch(5)
    raw = ppo_advantages(GAEConfig(gae_gamma=0.9, normalize_advantages=False), rewards, values, mask)
    out = ppo_advantages(GAEConfig(gae_gamma=0.9, normalize_advantages=True), rewards, values, mask)
    close(out.advantages, reference_whiten(raw.advantages.double(), mask))
    close(out.returns, raw.returns.double())  # the critic's targets are not whitened
    kept = out.advantages[mask].double()
    assert kept.mean().item() == pytest.approx(0.0, abs=1e-6) and kept.std().item() == pytest.approx(1.0, abs=1e-5)
    single = torch.zeros(1, 3, dtype=torch.bool)
    single[0, 1] = True
    assert not whiten(torch.tensor([[5.0, 2.0, 7.0]]), single).any()  # one token: centred, variance taken as 0


def test_a_training_batch_multi_turn_with_the_kl_in_the_reward():
    """From the batch as the loop holds it: a filtered row is all zeros, the sequence reward lands on the last token
    of the last turn, the KL per token is in the reward, and GAE bootstraps across the environment's tokens."""
    _, values, _ = batch(6)
    token_mask = torch.zeros(B, S)
    token_mask[0, 3:7] = 1.0
    token_mask[0, 9:12] = 1.0  # turn 2 after an observation at 7..8
    token_mask[1, 2:14] = 1.0
    token_mask[2, 4:8] = 1.0
    token_mask[3, 1:5] = 1.0
    g = torch.Generator().manual_seed(7)
    data = {
        "token_mask": token_mask,
        "sample_mask": torch.tensor([1.0, 1.0, 0.0, 1.0]),
        "values": values,
        "prev_logprobs": -torch.rand(B, S, generator=g),
        "reference_policy_logprobs": -torch.rand(B, S, generator=g),
    }
    rewards = torch.tensor([1.0, -1.0, 1.0, 0.5])
    beta, gamma, lam = 0.1, 0.99, 0.9
    loss_cfg = ClippedPGLossConfig(reference_policy_kl_penalty=beta, use_kl_in_reward=True)
    cfg = GAEConfig(gae_gamma=gamma, gae_lambda=lam, normalize_advantages=False)
    out = batch_advantages(cfg, loss_cfg, data, rewards)
    valid = (token_mask != 0) & (data["sample_mask"][:, None] != 0)
    per_token = torch.zeros(B, S, dtype=torch.float64)
    for b in range(B):
        positions = [i for i in range(1, S) if valid[b, i]]
        for i in positions:
            log_ratio = float(data["reference_policy_logprobs"][b, i]) - float(data["prev_logprobs"][b, i])
            per_token[b, i] = -beta * (math.exp(log_ratio) - 1 - log_ratio)
        if positions:
            per_token[b, positions[-1]] += float(rewards[b])
    adv, ret = reference_batch(per_token, values, valid, gamma, [lam] * B)
    close(out.advantages, adv)
    close(out.returns, ret)
    assert not out.advantages[2].any() and not out.returns[2].any()
    assert out.advantages[0, 7:9].tolist() == [0.0, 0.0]
    with pytest.raises(KeyError, match="values"):
        batch_advantages(cfg, loss_cfg, {k: v for k, v in data.items() if k != "values"}, rewards)
