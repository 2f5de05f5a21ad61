"""NeMo-RL's GRPO reward and advantage options (rlcore.algorithms.reward_transforms), against numbers worked out
by hand in the comments and against a plain-Python float64 recomputation."""

from __future__ import annotations

import random

import pytest
import torch

from rlcore.algorithms.grpo.config import GRPOConfig, RewardScalingConfig, RewardShapingConfig
from rlcore.algorithms.grpo.reward_transforms import (
    TransformedRewards,
    clip_advantages,
    groups_with_signal,
    overlong_sample_mask,
    scale_rewards,
    shape_rewards,
    transform_rewards,
)


def t(values, dtype=torch.float32):
    return torch.tensor(values, dtype=dtype)


def close(got: torch.Tensor, expected: list[float]) -> None:
    assert got.shape == (len(expected),), got.shape
    assert torch.allclose(got.double(), t(expected, torch.float64), atol=1e-6), (got.tolist(), expected)


# --- reward scaling ---------------------------------------------------------------------------


def test_scaling_clamps_to_the_source_range_then_maps_linearly():
    cfg = RewardScalingConfig(enabled=True, source_min=0.0, source_max=1.0, target_min=-1.0, target_max=1.0)
    # clamp to [0, 1]: -0.5 -> 0, 3 -> 1; then -1 + r * 2
    close(scale_rewards(t([-0.5, 0.0, 0.25, 1.0, 3.0]), cfg), [-1.0, -1.0, -0.5, 1.0, 1.0])


def test_scaling_an_offset_range():
    cfg = RewardScalingConfig(enabled=True, source_min=2.0, source_max=6.0, target_min=10.0, target_max=20.0)
    # clamp to [2, 6] -> [2, 2, 3, 5, 6, 6]; then 10 + (r - 2) / 4 * 10
    close(scale_rewards(t([1.0, 2.0, 3.0, 5.0, 6.0, 7.0]), cfg), [10.0, 10.0, 12.5, 17.5, 20.0, 20.0])


def test_scaling_onto_a_reversed_target_flips_the_order():
    cfg = RewardScalingConfig(enabled=True, target_min=1.0, target_max=0.0)
    close(scale_rewards(t([0.0, 0.25, 1.0]), cfg), [1.0, 0.75, 0.0])  # 1 + r * (0 - 1)


def test_scaling_off_changes_nothing_and_dtypes_are_kept():
    off = RewardScalingConfig(enabled=False, target_min=-1.0, target_max=1.0)
    rewards = t([-0.5, 0.3, 2.0])
    assert torch.equal(scale_rewards(rewards, off), rewards)
    on = RewardScalingConfig(enabled=True)
    assert scale_rewards(t([0.5], torch.float64), on).dtype == torch.float64
    assert scale_rewards(t([0.5]), on).dtype == torch.float32
    assert scale_rewards(torch.tensor([0, 1, 2]), on).tolist() == [0.0, 1.0, 1.0]  # int rewards become float
    with pytest.raises(ValueError, match="source_max"):
        scale_rewards(rewards, RewardScalingConfig(enabled=True, source_min=1.0, source_max=1.0))


def test_scaling_matches_a_float64_recomputation():
    rng = random.Random(0)
    values = [rng.uniform(-3, 3) for _ in range(64)]
    lo, hi, a, b = -1.5, 2.0, -4.0, 0.5
    cfg = RewardScalingConfig(enabled=True, source_min=lo, source_max=hi, target_min=a, target_max=b)
    expected = [a + (min(max(v, lo), hi) - lo) / (hi - lo) * (b - a) for v in values]
    assert torch.allclose(scale_rewards(t(values, torch.float64), cfg), t(expected, torch.float64), atol=1e-12)


# --- reward shaping ---------------------------------------------------------------------------

DAPO = RewardShapingConfig(enabled=True, overlong_buffer_length=4, overlong_buffer_penalty=1.0, max_response_length=10)


def test_dapo_overlong_penalty_inside_and_outside_the_buffer():
    # expected length = 10 - 4 = 6; penalty = min(0, -(L - 6) / 4 * 1)
    lengths = torch.tensor([0, 6, 7, 8, 10, 12])
    rewards = t([1.0, 1.0, 1.0, 1.0, 1.0, 0.0])
    close(
        shape_rewards(rewards, lengths, DAPO),
        [
            1.0,  # L=0: +1.5 capped at 0
            1.0,  # L=6: the buffer starts after this
            0.75,  # L=7: -1/4
            0.5,  # L=8: -2/4
            0.0,  # L=10 = max_response_length: the whole penalty
            -1.5,  # L=12: 0 - 6/4; past max_response_length it keeps growing (NeMo-RL)
        ],
    )


def test_dapo_penalty_scales_with_overlong_buffer_penalty_and_takes_lists():
    cfg = DAPO.model_copy(update={"overlong_buffer_penalty": 0.5})
    close(shape_rewards(t([0.0, 2.0]), [8, 9], cfg), [-0.25, 1.625])  # -2/4 * 0.5; 2 - 3/4 * 0.5


def test_dapo_matches_a_float64_recomputation():
    rng = random.Random(1)
    cfg = RewardShapingConfig(
        enabled=True, overlong_buffer_length=128, overlong_buffer_penalty=0.7, max_response_length=512
    )
    lengths = [rng.randint(0, 600) for _ in range(50)]
    rewards = [rng.choice([0.0, 1.0]) for _ in range(50)]
    expected = [r + min(-(n - 384) / 128 * 0.7, 0.0) for r, n in zip(rewards, lengths)]
    got = shape_rewards(t(rewards, torch.float64), torch.tensor(lengths), cfg)
    assert torch.allclose(got, t(expected, torch.float64), atol=1e-12)


def test_stop_properly_penalty_scales_truncated_rewards_and_ignores_the_dapo_keys():
    cfg = DAPO.model_copy(update={"stop_properly_penalty_coef": 0.1})
    truncated = torch.tensor([True, True, False, False])
    # truncated: r * 0.1; lengths are not looked at (None, or anything: the DAPO keys are ignored)
    close(shape_rewards(t([1.0, -1.0, 0.5, 1.0]), None, cfg, truncated), [0.1, -0.1, 0.5, 1.0])
    close(shape_rewards(t([1.0, 1.0]), torch.tensor([1000, 1000]), cfg, [False, False]), [1.0, 1.0])
    zero = RewardShapingConfig(enabled=True, stop_properly_penalty_coef=0.0)
    close(shape_rewards(t([1.0, 1.0]), None, zero, [True, False]), [0.0, 1.0])


def test_shaping_off_and_missing_inputs():
    off = DAPO.model_copy(update={"enabled": False})
    rewards = t([1.0, 1.0])
    assert torch.equal(shape_rewards(rewards, torch.tensor([100, 100]), off), rewards)
    with pytest.raises(ValueError, match="truncated"):
        shape_rewards(rewards, None, RewardShapingConfig(enabled=True, stop_properly_penalty_coef=0.5))
    with pytest.raises(ValueError, match="overlong_buffer_length"):
        shape_rewards(rewards, torch.tensor([1, 2]), RewardShapingConfig(enabled=True, max_response_length=8))
    with pytest.raises(ValueError, match="needs the response lengths"):
        shape_rewards(rewards, None, DAPO)
    with pytest.raises(ValueError, match=r"response lengths of shape \(3,\) for rewards of shape \(2,\)"):
        shape_rewards(rewards, torch.tensor([1, 2, 3]), DAPO)
    with pytest.raises(ValueError, match="truncated flags of shape"):
        shape_rewards(rewards, None, RewardShapingConfig(enabled=True, stop_properly_penalty_coef=0.5), [True])


# --- the entry point: scaling, then shaping -------------------------------------------------------


def grpo(**sections) -> GRPOConfig:
    return GRPOConfig.model_validate(sections)


def test_transform_rewards_scales_before_it_shapes():
    cfg = grpo(
        reward_scaling={"enabled": True, "target_min": -1.0, "target_max": 1.0},
        reward_shaping={"enabled": True, "stop_properly_penalty_coef": 0.5},
    )
    out = transform_rewards(cfg, t([1.0, 0.0, 1.0]), None, torch.tensor([True, True, False]))
    assert isinstance(out, TransformedRewards)
    # scaled: [1, -1, 1]; then truncated * 0.5: [0.5, -0.5, 1]
    # (shaping first would give 1*0.5 -> 0.0 and 0*0.5 -> -1: different numbers)
    close(out.rewards, [0.5, -0.5, 1.0])
    close(out.unshaped, [1.0, -1.0, 1.0])


def test_transform_rewards_dapo_penalty_is_in_scaled_units():
    cfg = grpo(
        reward_scaling={"enabled": True, "target_min": 0.0, "target_max": 10.0},
        reward_shaping={
            "enabled": True,
            "overlong_buffer_length": 4,
            "overlong_buffer_penalty": 1.0,
            "max_response_length": 10,
        },
    )
    out = transform_rewards(cfg, t([1.0, 0.2]), torch.tensor([8, 3]), torch.tensor([False, False]))
    close(out.rewards, [9.5, 2.0])  # 10 - 2/4; 2 (short: no penalty)
    close(out.unshaped, [10.0, 2.0])


def test_transform_rewards_with_everything_off_is_the_identity():
    rewards = t([0.3, -2.0, 7.0])
    out = transform_rewards(GRPOConfig(), rewards)
    assert torch.equal(out.rewards, rewards) and torch.equal(out.unshaped, rewards)


# --- dynamic sampling's filter ------------------------------------------------------------------


def test_groups_with_signal_all_equal_versus_one_differing_reward():
    rewards = t(
        [
            1,
            1,
            1,
            1,  # all equal: no signal
            1,
            0,
            0,
            0,  # the first differs (NeMo-RL's leave-one-out std drops that very sample)
            0,
            0,
            0,
            0,  # all equal
            0,
            0,
            0,
            1,  # the last differs
            0.3,
            0.3,
            0.3,
            0.3 + 1e-6,
        ],
        torch.float64,
    )  # a tiny difference is a difference
    assert groups_with_signal(rewards, 4).tolist() == [False, True, False, True, True]


def test_groups_with_signal_agrees_with_a_positive_std():
    rng = random.Random(2)
    rewards = t([rng.choice([0.0, 0.5, 1.0]) for _ in range(3 * 200)], torch.float64)
    expected = [float(torch.std(g)) > 0 for g in rewards.view(-1, 3)]
    assert groups_with_signal(rewards, 3).tolist() == expected
    assert any(expected) and not all(expected)


def test_groups_with_signal_edge_cases():
    assert groups_with_signal(t([1.0, 0.0, 2.0]), 1).tolist() == [False, False, False]  # one sample: never
    with pytest.raises(ValueError, match="whole groups"):
        groups_with_signal(t([1.0, 0.0, 2.0]), 2)


def test_dynamic_sampling_judges_the_rewards_before_shaping():
    """Two correct completions of different lengths: the penalty makes them differ, the task's reward does not."""
    cfg = grpo(
        reward_shaping={
            "enabled": True,
            "overlong_buffer_length": 4,
            "overlong_buffer_penalty": 1.0,
            "max_response_length": 10,
        }
    )
    out = transform_rewards(cfg, t([1.0, 1.0]), torch.tensor([5, 9]), None)
    close(out.rewards, [1.0, 0.25])  # 1 - 3/4
    assert groups_with_signal(out.rewards, 2).tolist() == [True]
    assert groups_with_signal(out.unshaped, 2).tolist() == [False]


# --- overlong filtering and advantage clipping ---------------------------------------------------


def test_overlong_sample_mask():
    mask = overlong_sample_mask(torch.tensor([True, False, True, False]))
    assert mask.dtype == torch.float32 and mask.tolist() == [0.0, 1.0, 0.0, 1.0]
    assert overlong_sample_mask([False, True]).tolist() == [1.0, 0.0]
    sample_mask = t([1.0, 1.0, 0.0])  # a sample already masked stays masked
    assert (sample_mask * overlong_sample_mask(torch.tensor([True, False, False]))).tolist() == [0.0, 1.0, 0.0]


@pytest.mark.parametrize(
    "low, high, expected",
    [
        (-2.0, 3.0, [-2.0, -1.0, 0.0, 2.0, 3.0]),
        (None, 3.0, [-3.0, -1.0, 0.0, 2.0, 3.0]),
        (-2.0, None, [-2.0, -1.0, 0.0, 2.0, 5.0]),
        (None, None, [-3.0, -1.0, 0.0, 2.0, 5.0]),
        (0.0, 0.0, [0.0, 0.0, 0.0, 0.0, 0.0]),
    ],
)
def test_clip_advantages(low, high, expected):
    close(clip_advantages(t([-3.0, -1.0, 0.0, 2.0, 5.0]), low, high), expected)


def test_clip_advantages_keeps_token_level_shapes():
    adv = t([[-4.0, 0.5], [2.5, 9.0]])
    assert clip_advantages(adv, -1.0, 2.0).tolist() == [[-1.0, 0.5], [2.0, 2.0]]


class RecordingPolicy:
    """Takes the training call's data (the loop's bookkeeping is what is tested; the backends have their own)."""

    def __init__(self) -> None:
        self.trained = None

    def prepare_for_training(self) -> None: ...

    def finish_training(self) -> None: ...

    def train(self, data, loss_fn):
        self.trained = data
        return {"loss": torch.zeros(1), "grad_norm": torch.zeros(1), "metrics": {}}


def test_a_training_step_applies_the_options_in_nemo_rls_order():
    from types import SimpleNamespace

    from rlcore.algorithms.grpo.step import train_on_rollout
    from rlcore.config import load_config_dict
    from rlcore.run.rollouts import Rollout
    from rlcore.run.step import Timer

    cfg = load_config_dict(
        {
            "grpo": {
                "num_prompts_per_step": 2,
                "num_generations_per_prompt": 4,
                "advantage_estimator": "mean",
                "reward_scaling": {"enabled": True, "target_min": -1.0, "target_max": 1.0},
                "reward_shaping": {"enabled": True, "stop_properly_penalty_coef": 0.5},
                "advantage_clip_high": 0.5,
                "overlong_filtering": True,
            },
            "loss": {"reference_policy_kl_penalty": 0.0},
        }
    )
    mask = torch.zeros(8, 4)
    mask[:, 2:] = 1  # 2 prompt tokens, 2 generated
    truncated = torch.tensor([False, False, False, True, True, False, False, False])
    data = {
        "output_ids": torch.zeros(8, 4, dtype=torch.long),
        "logprobs": torch.zeros(8, 4),
        "token_mask": mask,
        "unpadded_sequence_lengths": torch.full((8,), 4),
        "truncated": truncated,
        "first_turn_lengths": torch.full((8,), 2),
        "generation_lengths": torch.full((8,), 2),
    }
    policy = RecordingPolicy()
    loss_fn = SimpleNamespace(cfg=SimpleNamespace(force_on_policy_ratio=True, positive_example_nll_weight=0.0))
    run = SimpleNamespace(cfg=cfg, policy=policy, synchronizer=None)
    metrics = train_on_rollout(run, loss_fn, Rollout(data, t([1, 0, 0, 0, 1, 1, 1, 1])), Timer())
    # scaled 0/1 -> -1/1: [1, -1, -1, -1, 1, 1, 1, 1]; the truncated (3, 4) halved: [1, -1, -1, -.5, .5, 1, 1, 1];
    # minus the group means (-0.375, 0.875): [1.375, -.625, -.625, -.125, -.375, .125, .125, .125]; clipped at 0.5
    close(policy.trained["advantages"][:, 2], [0.5, -0.625, -0.625, -0.125, -0.375, 0.125, 0.125, 0.125])
    assert policy.trained["advantages"][:, :2].abs().sum() == 0  # prompt tokens carry none
    close(policy.trained["sample_mask"], [1, 1, 1, 0, 0, 1, 1, 1])  # truncated samples out of the loss
    assert metrics["reward_mean"] == pytest.approx(0.625)  # the environment's rewards
    assert metrics["reward_transformed_mean"] == pytest.approx(0.25)
    assert metrics["overlong_filtered_fraction"] == pytest.approx(0.25)
