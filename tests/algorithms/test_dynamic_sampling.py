"""Dynamic sampling's bookkeeping (:func:`rlcore.algorithms.grpo.dynamic_sampling.sample_with_signal`) on
hand-made rollouts: which groups a step keeps, in which order, padded how, and what it reports. The real run is in
tests/run/test_task_runs.py."""

from __future__ import annotations

import pytest
import torch

from rlcore.algorithms.grpo.dynamic_sampling import DynamicSamplingError, sample_with_signal
from rlcore.config import load_config_dict
from rlcore.datasets import DataExhausted
from rlcore.run.rollouts import Rollout

PAD = 99


def _cfg(**grpo):
    grpo = {"num_prompts_per_step": 2, "num_generations_per_prompt": 2, "use_dynamic_sampling": True, **grpo}
    batch = grpo["num_prompts_per_step"] * grpo["num_generations_per_prompt"]
    return load_config_dict(
        {
            "grpo": grpo,
            "policy": {"train_global_batch_size": batch, "train_micro_batch_size": 1, "logprob_batch_size": 1},
        }
    )


def _rollout(rewards: list[float], prompt_id: list[int], length: int, env_errors: float = 0.0) -> Rollout:
    """Trajectories of ``length`` tokens whose every token is its prompt's id (so a test can see which rows
    were kept), each with 1 generated token."""
    n = len(rewards)
    ids = torch.tensor([[p] * length for p in prompt_id], dtype=torch.long)
    mask = torch.zeros(n, length)
    mask[:, -1] = 1
    data = {
        "output_ids": ids,
        "logprobs": -mask,
        "token_mask": mask,
        "input_lengths": torch.full((n,), length - 1),
        "unpadded_sequence_lengths": torch.full((n,), length),
        "generation_lengths": torch.ones(n, dtype=torch.long),
        "first_turn_lengths": torch.ones(n, dtype=torch.long),
        "truncated": torch.zeros(n, dtype=torch.bool),
    }
    from rlcore.data import BatchedDataDict

    return Rollout(
        BatchedDataDict(data),
        torch.tensor(rewards, dtype=torch.float32),
        {"env/errors": env_errors, "rollout/turns_mean": float(length)},
    )


class Batches:
    """``draw`` hands out batch numbers (as the data source would samples); ``roll_out`` looks up the scripted
    rollout of each; both count their calls."""

    def __init__(self, rollouts: list[Rollout]) -> None:
        self.rollouts, self.drawn = rollouts, 0

    def draw(self) -> list[int]:
        if self.drawn == len(self.rollouts):
            raise DataExhausted("used up")
        self.drawn += 1
        return [self.drawn - 1]

    def roll_out(self, samples: list[int]) -> Rollout:
        return self.rollouts[samples[0]]


def test_a_step_keeps_the_groups_with_signal_in_order_until_it_is_full():
    # groups of 2; batch 0: prompt 10 flat, 11 differs; batch 1 (longer sequences): 12 flat, 13 and 14 differ
    batches = Batches(
        [
            _rollout([1, 1, 0, 1], [10, 10, 11, 11], 3, env_errors=1),
            _rollout([0, 0, 1, 0, 0, 1], [12, 12, 13, 13, 14, 14], 5, env_errors=2),
            _rollout([0, 1, 0, 1], [15, 15, 16, 16], 3),
        ]
    )
    rollout, metrics = sample_with_signal(_cfg(), batches.draw, batches.roll_out, PAD)
    assert batches.drawn == 2  # full after the second batch: the third is never drawn
    assert rollout.data["output_ids"][:, 0].tolist() == [11, 11, 13, 13]  # 14 is surplus, 10 and 12 are flat
    assert rollout.rewards.tolist() == [0, 1, 1, 0]
    # batch 0's rows were 3 wide: padded with the pad id to the longest, and nothing wider than that
    assert rollout.data["output_ids"].shape == (4, 5)
    assert rollout.data["output_ids"][:2, 3:].eq(PAD).all() and rollout.data["token_mask"][:2, 3:].eq(0).all()
    everything = torch.tensor([1, 1, 0, 1, 0, 0, 1, 0, 0, 1], dtype=torch.float64)
    assert metrics["reward_mean"] == pytest.approx(float(everything.mean()))
    assert metrics["reward_std"] == pytest.approx(float(everything.std()))
    assert metrics["filtered_reward_mean"] == 0.5
    assert metrics["dynamic_sampling/gen_batches"] == 2
    assert metrics["dynamic_sampling/groups_with_signal_fraction"] == pytest.approx(3 / 5)
    assert metrics["dynamic_sampling/discarded_valid_samples"] == 2  # prompt 14's two completions
    assert metrics["dynamic_sampling/generated_tokens"] == 10
    assert rollout.metrics == {"env/errors": 3.0, "rollout/turns_mean": 4.0}  # errors add up; means average


def test_signal_is_judged_after_scaling_and_before_shaping():
    # rewards 1 and 2 clamp to the same scaled reward; a length penalty would make a flat group differ
    shaping = {"enabled": True, "overlong_buffer_length": 2, "overlong_buffer_penalty": 1.0, "max_response_length": 3}
    cfg = _cfg(num_prompts_per_step=1, reward_scaling={"enabled": True, "source_max": 1.0}, reward_shaping=shaping)
    flat = _rollout([1, 2, 1, 1], [20, 20, 21, 21], 4)
    flat.data["first_turn_lengths"] = torch.tensor([1, 3, 1, 3])  # prompt 21's pair: penalties 0 and -1
    batches = Batches([flat, _rollout([0, 1], [22, 22], 2)])
    rollout, metrics = sample_with_signal(cfg, batches.draw, batches.roll_out, PAD)
    assert rollout.data["output_ids"][:, 0].tolist() == [22, 22]
    assert metrics["dynamic_sampling/gen_batches"] == 2
    assert rollout.rewards.tolist() == [0, 1]  # the environment's rewards: the step transforms them itself


def test_too_few_groups_within_the_batch_limit_is_an_error_that_says_what_to_change():
    batches = Batches([_rollout([1, 1, 0, 1], [30, 30, 31, 31], 2)] + [_rollout([1, 1, 0, 0], [32, 32, 33, 33], 2)] * 4)
    with pytest.raises(DynamicSamplingError) as info:
        sample_with_signal(_cfg(dynamic_sampling_max_gen_batches=3), batches.draw, batches.roll_out, PAD)
    assert batches.drawn == 3
    message = str(info.value)
    assert message.startswith(
        "grpo.dynamic_sampling_max_gen_batches: 3 generation batches of 2 prompts gave 1 of the 2 groups"
    ), message
    assert "raise dynamic_sampling_max_gen_batches" in message


def test_the_end_of_the_data_inside_a_step_reaches_the_loop():
    batches = Batches([_rollout([1, 1, 0, 1], [40, 40, 41, 41], 2)])
    with pytest.raises(DataExhausted):
        sample_with_signal(_cfg(), batches.draw, batches.roll_out, PAD)


def test_generation_batches_are_num_prompts_per_step_times_batch_multiplier_rounded_down():
    cfg = _cfg(num_prompts_per_step=5, batch_multiplier=1.5)
    assert cfg.grpo.prompts_per_generation_batch == 7
    assert _cfg(num_prompts_per_step=5, use_dynamic_sampling=False).grpo.prompts_per_generation_batch == 5
