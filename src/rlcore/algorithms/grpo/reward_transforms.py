"""NeMo-RL's GRPO reward and advantage options as pure functions on CPU tensors.

They cover ``grpo.reward_scaling``, ``grpo.reward_shaping``,
``grpo.use_dynamic_sampling``, ``grpo.advantage_clip_low/high`` and
``grpo.overlong_filtering``. A training step applies them in NeMo-RL's order
(``grpo_train`` in ``nemo_rl/algorithms/grpo.py``):

1. :func:`transform_rewards`: :func:`scale_rewards`, then :func:`shape_rewards`.
2. Dynamic sampling (:mod:`rlcore.algorithms.grpo.dynamic_sampling`): :func:`groups_with_signal`
   on the rewards *before* shaping (``TransformedRewards.unshaped``), so that a
   length penalty does not make a group look informative; groups without
   signal are dropped and more are generated.
3. Overlong filtering: :func:`overlong_sample_mask` multiplies the sample mask
   of the samples kept.
4. Advantages from the shaped rewards (``TransformedRewards.rewards``) of the
   samples kept; the baseline sees every sample of the group, filtered or
   not; Reinforce++'s batch whitening sees only the samples the mask keeps.
5. :func:`clip_advantages`.

Each option off leaves its input unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

if TYPE_CHECKING:
    import torch

    from rlcore.algorithms.grpo.config import RewardScalingConfig, RewardShapingConfig


def _as_tensor(values: Any, dtype: torch.dtype) -> torch.Tensor:
    import torch

    return values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)


def _result_dtype(rewards: torch.Tensor) -> torch.dtype:
    import torch

    return rewards.dtype if rewards.is_floating_point() else torch.float32


def scale_rewards(rewards: torch.Tensor, cfg: RewardScalingConfig) -> torch.Tensor:
    """``rewards [B]`` clamped into ``[source_min, source_max]``, then mapped linearly onto
    ``[target_min, target_max]``; unchanged when ``cfg.enabled`` is false.

    The clamp comes first so that a reward outside the expected range (a verifier's bonus, a bug) cannot
    land outside the target range the rest of the step was tuned for.
    """
    if not cfg.enabled:
        return rewards
    lo, hi = float(cfg.source_min), float(cfg.source_max)
    if hi <= lo:
        raise ValueError(f"reward_scaling: source_max {hi} must be > source_min {lo}")
    r = rewards.double().clamp(min=lo, max=hi)
    scaled = cfg.target_min + (r - lo) / (hi - lo) * (cfg.target_max - cfg.target_min)
    return scaled.to(_result_dtype(rewards))


def shape_rewards(
    rewards: torch.Tensor,
    response_lengths: torch.Tensor | None,
    cfg: RewardShapingConfig,
    truncated: torch.Tensor | None = None,
) -> torch.Tensor:
    """``rewards [B]`` with NeMo-RL's length penalties; unchanged when ``cfg.enabled`` is false.

    - ``stop_properly_penalty_coef`` set: the reward of each ``truncated [B]`` (bool) sample is multiplied
      by it, so that running out of tokens is never as good as finishing; ``response_lengths`` is not used.
    - otherwise DAPO's overlong penalty: with ``expected = max_response_length - overlong_buffer_length``,
      a completion of ``L = response_lengths[i]`` tokens gets
      ``min(0, -(L - expected) / overlong_buffer_length * overlong_buffer_penalty)`` added, a soft signal
      that long answers cost before the hard cut arrives. Past ``max_response_length`` the penalty keeps
      growing linearly (NeMo-RL's code; the DAPO paper holds it at ``-overlong_buffer_penalty``).

    ``response_lengths`` counts the tokens of each completion's first assistant turn (NeMo-RL's
    ``response_token_lengths``: the whole completion of a single-turn rollout).
    """
    import torch

    if not cfg.enabled:
        return rewards
    out_dtype = _result_dtype(rewards)
    r = rewards.double()
    if cfg.stop_properly_penalty_coef is not None:
        if truncated is None:
            raise ValueError("reward_shaping.stop_properly_penalty_coef needs which samples were truncated")
        cut = _as_tensor(truncated, torch.bool)
        if cut.shape != r.shape:
            raise ValueError(f"truncated flags of shape {tuple(cut.shape)} for rewards of shape {tuple(r.shape)}")
        return torch.where(cut, r * cfg.stop_properly_penalty_coef, r).to(out_dtype)
    buffer, penalty, max_len = cfg.overlong_buffer_length, cfg.overlong_buffer_penalty, cfg.max_response_length
    if buffer is None or penalty is None or max_len is None:
        raise ValueError(
            "reward_shaping: DAPO's overlong penalty needs overlong_buffer_length, "
            "overlong_buffer_penalty and max_response_length"
        )
    if response_lengths is None:
        raise ValueError("reward_shaping: DAPO's overlong penalty needs the response lengths")
    lengths = _as_tensor(response_lengths, torch.float64)
    if lengths.shape != r.shape:
        raise ValueError(f"response lengths of shape {tuple(lengths.shape)} for rewards of shape {tuple(r.shape)}")
    expected = max_len - buffer
    overlong = (-(lengths - expected) / buffer * penalty).clamp(max=0.0)
    return (r + overlong).to(out_dtype)


class RewardTransforms(Protocol):
    """A section with the two reward transforms (``grpo``, ``ppo``)."""

    reward_scaling: RewardScalingConfig
    reward_shaping: RewardShapingConfig


class TransformedRewards(NamedTuple):
    """What :func:`transform_rewards` gives a step."""

    rewards: torch.Tensor  #: scaled, then shaped ``[B]``: what the baselines and advantages are computed from
    unshaped: torch.Tensor  #: scaled only ``[B]``: what dynamic sampling judges a group's signal by


def transform_rewards(
    section: RewardTransforms,
    rewards: torch.Tensor,
    response_lengths: torch.Tensor | None = None,
    truncated: torch.Tensor | None = None,
) -> TransformedRewards:
    """``reward_scaling``, then ``reward_shaping`` of ``section`` (``grpo``'s, ``ppo``'s: NeMo-RL's PPO shares its
    GRPO's transforms), on the environment's ``rewards [B]``.

    Scaling comes first (NeMo-RL's order), so the shaping penalties are in the scaled units. The rewards
    between the two are kept for dynamic sampling, which NeMo-RL filters on the task's own signal, not on
    the length-dependent penalty. ``response_lengths [B]``: tokens of each completion's first assistant
    turn; ``truncated [B]`` (bool): the completion was cut by a token budget; each needed only by the
    shaping form that uses it.
    """
    scaled = scale_rewards(rewards, section.reward_scaling)
    return TransformedRewards(shape_rewards(scaled, response_lengths, section.reward_shaping, truncated), scaled)


def groups_with_signal(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[B // group_size]`` bool: whether the rewards of each group (consecutive runs of ``group_size``)
    are not all equal, i.e. whether its group-relative advantages can be non-zero.

    Dynamic sampling keeps only these groups: an all-equal group only adds zeros to the batch. Compared
    exactly; NeMo-RL tests ``std != 0`` per sample, which with its leave-one-out std drops the single
    differing sample of a group (its others are all equal) and keeps the rest.
    """
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards are not whole groups of {group_size}")
    groups = rewards.reshape(-1, group_size)
    return (groups != groups[:, :1]).any(dim=1)


def overlong_sample_mask(truncated: torch.Tensor) -> torch.Tensor:
    """``[B]`` float32: 0 for a truncated sample, 1 otherwise; multiplied into the sample mask.

    A truncated completion's reward judges an unfinished answer, so overlong filtering keeps it out of
    the loss rather than teach from it.
    """
    import torch

    return 1.0 - _as_tensor(truncated, torch.bool).to(torch.float32)


def clip_advantages(advantages: torch.Tensor, low: float | None, high: float | None) -> torch.Tensor:
    """``advantages`` (any shape) clamped to ``[low, high]``; ``None`` = no bound on that side.

    Normalizing by a tiny group std can blow an advantage up; the bounds cap one sample's pull on the update.
    """
    if low is not None:
        advantages = advantages.clamp(min=low)
    if high is not None:
        advantages = advantages.clamp(max=high)
    return advantages


__all__ = [
    "TransformedRewards",
    "clip_advantages",
    "groups_with_signal",
    "overlong_sample_mask",
    "scale_rewards",
    "shape_rewards",
    "transform_rewards",
]
