"""grpo.invalid_tool_call_advantage: the tokens of flagged assistant turns get the configured advantage, before the
clip (NeMo-RL's order), and invalid_tool_call_rate counts flagged turns over turns; checked against a plain-Python
recomputation on a crafted two-turn batch."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

# Two groups of two samples, 10 positions: prompt [0, 2), turn 1 [2, 5), observation [5, 7), turn 2 [7, 9), pad 9.
# Sample 3 stopped after its first turn. Flagged: sample 0's turn 1, sample 2's turn 2, sample 3's turn 1.
TURNS = {0: [(2, 5), (7, 9)], 1: [(2, 5), (7, 9)], 2: [(2, 5), (7, 9)], 3: [(2, 5)]}
FLAGGED = {(0, 0), (2, 1), (3, 0)}
REWARDS = [1.0, 0.0, 0.5, 0.25]


def rollout(with_mask: bool = True):
    from rlcore.run.rollouts import Rollout

    token_mask, flagged = torch.zeros(4, 10), torch.zeros(4, 10, dtype=torch.bool)
    for i, spans in TURNS.items():
        for k, (a, b) in enumerate(spans):
            token_mask[i, a:b] = 1
            flagged[i, a:b] = (i, k) in FLAGGED
    data = {
        "output_ids": torch.zeros(4, 10, dtype=torch.long),
        "logprobs": torch.zeros(4, 10),
        "token_mask": token_mask,
        "unpadded_sequence_lengths": torch.tensor([9, 9, 9, 7]),
        "truncated": torch.zeros(4, dtype=torch.bool),
        "first_turn_lengths": torch.full((4,), 3),
        "generation_lengths": token_mask.sum(dim=1).long(),
    }
    if with_mask:
        data["invalid_tool_call_mask"] = flagged
    return Rollout(data, torch.tensor(REWARDS))


def expected(value: float | None, low: float | None = None) -> list[list[float]]:
    """Leave-one-out advantages by hand (groups of 2: r_i - r_other), each flagged turn's tokens set to ``value``,
    then clipped at ``low``; 0 off the generated tokens."""
    other = {0: 1, 1: 0, 2: 3, 3: 2}
    rows = []
    for i in range(4):
        row = [0.0] * 10
        for k, (a, b) in enumerate(TURNS[i]):
            for pos in range(a, b):
                adv = REWARDS[i] - REWARDS[other[i]]
                if value is not None and (i, k) in FLAGGED:
                    adv = value
                row[pos] = max(adv, low) if low is not None else adv
        rows.append(row)
    return rows


class RecordingPolicy:
    def __init__(self) -> None:
        self.trained = None

    def prepare_for_training(self) -> None: ...

    def finish_training(self) -> None: ...

    def train(self, data, loss_fn):
        self.trained = data
        return {"loss": torch.zeros(1), "grad_norm": torch.zeros(1), "metrics": {}}


def train(grpo: dict, data=None) -> tuple[torch.Tensor, dict[str, float]]:
    from rlcore.algorithms.grpo.step import train_on_rollout
    from rlcore.config import load_config_dict
    from rlcore.run.step import Timer

    cfg = load_config_dict(
        {
            "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 2, **grpo},
            "loss": {"reference_policy_kl_penalty": 0.0},
            "policy": {"train_global_batch_size": 4},
        }
    )
    policy = RecordingPolicy()
    loss_fn = SimpleNamespace(cfg=SimpleNamespace(force_on_policy_ratio=True, positive_example_nll_weight=0.0))
    metrics = train_on_rollout(
        SimpleNamespace(cfg=cfg, policy=policy, synchronizer=None), loss_fn, data or rollout(), Timer()
    )
    return policy.trained["advantages"], metrics


@pytest.mark.parametrize(
    ("grpo", "value", "low"),
    [
        ({"invalid_tool_call_advantage": -5.0}, -5.0, None),
        ({"invalid_tool_call_advantage": -5.0, "advantage_clip_low": -2.0}, -5.0, -2.0),  # set, then clipped
        ({}, None, None),  # null: advantages as computed
    ],
)
def test_flagged_turns_get_the_configured_advantage_before_the_clip(grpo, value, low):
    advantages, metrics = train({"advantage_estimator": "leave_one_out", **grpo})
    torch.testing.assert_close(advantages, torch.tensor(expected(value, low)))
    if value is None:  # logged with the override only, as NeMo-RL does (the tools environment has its own metrics)
        assert "invalid_tool_call_rate" not in metrics
    else:
        assert metrics["invalid_tool_call_rate"] == pytest.approx(3 / 7)  # 3 flagged of 7 assistant turns


def test_without_the_mask_nothing_changes_and_no_rate_is_logged():
    advantages, metrics = train(
        {"advantage_estimator": "leave_one_out", "invalid_tool_call_advantage": -5.0}, rollout(with_mask=False)
    )
    torch.testing.assert_close(advantages, torch.tensor(expected(None)))
    assert "invalid_tool_call_rate" not in metrics


def test_token_level_advantages_are_overridden_too():
    plain, _ = train({"advantage_estimator": "reinforce_plus_plus"})
    flagged, _ = train({"advantage_estimator": "reinforce_plus_plus", "invalid_tool_call_advantage": -5.0})
    hit = rollout().data["invalid_tool_call_mask"]
    assert torch.equal(flagged[hit], torch.full((int(hit.sum()),), -5.0))
    assert torch.equal(flagged[~hit], plain[~hit])
    assert plain[hit].abs().sum() > 0  # the override changed something


def test_the_key_is_a_float_or_null():
    from rlcore.algorithms.grpo.config import GRPOConfig

    assert GRPOConfig().invalid_tool_call_advantage is None
    with pytest.raises(ValueError, match="invalid_tool_call_advantage"):
        GRPOConfig(invalid_tool_call_advantage="very negative")
