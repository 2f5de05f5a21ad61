"""The rewards PPO's GAE reads, in NeMo-RL's order (``ppo_train`` and ``GeneralizedAdvantageEstimator``):

1. ``ppo.reward_scaling`` then ``ppo.reward_shaping`` on the sequence rewards: GRPO's own transforms
   (:func:`rlcore.algorithms.grpo.reward_transforms.transform_rewards` on the ``ppo`` section), which NeMo-RL's PPO
   shares with its GRPO;
2. :func:`kl_reward`: with ``loss.use_kl_in_reward``, ``-beta * KL(pi_prev || pi_ref)`` at every generated token,
   the estimator and clamps of the ``loss`` section (as Reinforce++'s KL in the reward);
3. :func:`token_rewards`: the sequence reward on each row's last generated token, plus the per-token terms.

Importing this module does not import torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from rlcore.algorithms.grpo.loss_config import ClippedPGLossConfig


def kl_reward(loss_cfg: ClippedPGLossConfig, data: Mapping[str, Any]) -> torch.Tensor | None:
    """``[B, S]``: ``-reference_policy_kl_penalty * KL`` per token with ``loss.use_kl_in_reward`` and a
    coefficient > 0, from ``data['prev_logprobs']`` and ``data['reference_policy_logprobs']`` (the loss's
    estimator and clamps); None otherwise (the KL, if any, is then the loss's term)."""
    from rlcore.algorithms.utils import kl_estimate

    beta = loss_cfg.reference_policy_kl_penalty
    if not loss_cfg.use_kl_in_reward or beta <= 0:
        return None
    for key in ("prev_logprobs", "reference_policy_logprobs"):
        if data.get(key) is None:
            raise KeyError(f"loss.use_kl_in_reward puts the KL into PPO's rewards: it needs data[{key!r}]")
    kl = kl_estimate(
        data["reference_policy_logprobs"] - data["prev_logprobs"],
        loss_cfg.reference_policy_kl_type,
        loss_cfg.kl_input_clamp_value,
        loss_cfg.kl_output_clamp_value,
    )
    return -beta * kl


def token_rewards(rewards: torch.Tensor, mask: torch.Tensor, per_token: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, S]`` float64: ``rewards [B]`` on each row's last token of ``mask`` (in a multi-turn rollout the last
    generated token, whatever follows it), plus ``per_token [B, S]`` (e.g. :func:`kl_reward`); 0 off the mask and
    on rows without a token on it."""
    import torch

    valid = torch.as_tensor(mask, device=rewards.device) != 0
    out = torch.zeros(valid.shape, dtype=torch.float64, device=rewards.device)
    if per_token is not None:
        out = torch.where(valid, per_token.to(torch.float64), out)
    last = valid.shape[1] - 1 - valid.flip(1).to(torch.int8).argmax(dim=1)
    has_token = valid.any(dim=1)
    row = torch.arange(valid.shape[0], device=rewards.device)
    out[row[has_token], last[has_token]] += rewards.to(torch.float64)[has_token]
    return out


__all__ = ["kl_reward", "token_rewards"]
