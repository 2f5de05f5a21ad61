"""The rewards PPO's GAE reads (rlcore.algorithms.ppo.rewards): scaling bounds and shaping of the ppo section,
the sequence reward on the last generated token, the KL in the reward; each against a float64 recomputation in
plain Python."""

from __future__ import annotations

import math

import pytest
import torch

from rlcore.algorithms.grpo.loss_config import ClippedPGLossConfig
from rlcore.algorithms.grpo.reward_transforms import transform_rewards
from rlcore.algorithms.ppo.config import PPOConfig
from rlcore.algorithms.ppo.rewards import kl_reward, token_rewards

REWARDS = [-0.5, 0.0, 0.25, 1.0, 1.7]


@pytest.mark.parametrize("source,target", [((0.0, 1.0), (-1.0, 1.0)), ((-1.0, 2.0), (0.5, 3.0))])
def test_reward_scaling_clamps_to_the_source_range_then_maps_onto_the_target(source, target):
    cfg = PPOConfig(
        reward_scaling={
            "enabled": True,
            "source_min": source[0],
            "source_max": source[1],
            "target_min": target[0],
            "target_max": target[1],
        }
    )
    got = transform_rewards(cfg, torch.tensor(REWARDS))
    expected = []
    for r in REWARDS:
        clamped = min(max(r, source[0]), source[1])
        expected.append(target[0] + (clamped - source[0]) * (target[1] - target[0]) / (source[1] - source[0]))
    assert got.rewards.tolist() == pytest.approx(expected, abs=1e-6)
    assert got.unshaped.tolist() == pytest.approx(expected, abs=1e-6)
    assert transform_rewards(PPOConfig(), torch.tensor(REWARDS)).rewards.tolist() == pytest.approx(REWARDS)


def test_reward_shaping_dapo_overlong_penalty_after_scaling():
    shaping = {"enabled": True, "overlong_buffer_length": 4, "overlong_buffer_penalty": 0.5, "max_response_length": 10}
    cfg = PPOConfig(reward_scaling={"enabled": True, "target_min": -1.0}, reward_shaping=shaping)
    lengths = [3, 6, 7, 10, 12]
    got = transform_rewards(cfg, torch.tensor(REWARDS), torch.tensor(lengths))
    expected = []
    for r, n in zip(REWARDS, lengths):
        scaled = -1.0 + 2.0 * min(max(r, 0.0), 1.0)
        expected.append(scaled + min(0.0, -(n - (10 - 4)) / 4 * 0.5))
    assert got.rewards.tolist() == pytest.approx(expected, abs=1e-6)


def test_reward_shaping_stop_properly_penalty_scales_truncated_rewards():
    cfg = PPOConfig(reward_shaping={"enabled": True, "stop_properly_penalty_coef": 0.25})
    truncated = [False, True, True, False, True]
    got = transform_rewards(cfg, torch.tensor(REWARDS), truncated=torch.tensor(truncated))
    assert got.rewards.tolist() == pytest.approx([r * 0.25 if t else r for r, t in zip(REWARDS, truncated)])


def test_token_rewards_put_the_sequence_reward_on_the_last_generated_token():
    mask = torch.tensor([[0, 1, 1, 0, 1, 1, 0], [0, 0, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    per_token = torch.arange(21, dtype=torch.float32).view(3, 7) / 10
    got = token_rewards(torch.tensor([2.0, -1.0, 5.0]), mask, per_token)
    expected = [[0.0] * 7 for _ in range(3)]
    for b, reward in enumerate([2.0, -1.0, 5.0]):
        positions = [i for i in range(7) if mask[b, i]]
        for i in positions:
            expected[b][i] = float(per_token[b, i])
        if positions:
            expected[b][positions[-1]] += reward
    assert got.dtype == torch.float64
    assert torch.allclose(got, torch.tensor(expected, dtype=torch.float64))


def test_kl_in_the_reward_is_minus_beta_times_the_loss_estimator():
    prev = torch.tensor([[0.0, -1.0, -2.0, -0.5]])
    ref = torch.tensor([[0.0, -1.5, -1.0, -0.5]])
    data = {"prev_logprobs": prev, "reference_policy_logprobs": ref}
    beta = 0.05
    cfg = ClippedPGLossConfig(reference_policy_kl_penalty=beta, use_kl_in_reward=True, reference_policy_kl_type="k3")
    got = kl_reward(cfg, data)
    assert got is not None
    expected = []
    for p, q in zip(prev[0].tolist(), ref[0].tolist()):
        log_ratio = q - p
        expected.append(-beta * (math.exp(log_ratio) - 1 - log_ratio))
    assert got[0].tolist() == pytest.approx(expected, abs=1e-7)
    assert kl_reward(ClippedPGLossConfig(reference_policy_kl_penalty=beta), data) is None  # the KL stays in the loss
    with pytest.raises(KeyError, match="reference_policy_logprobs"):
        kl_reward(cfg, {"prev_logprobs": prev})
