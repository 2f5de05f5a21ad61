"""Generalized advantage estimation (https://arxiv.org/abs/1506.02438) per token over a right-padded batch, as
NeMo-RL's ``GeneralizedAdvantageEstimator`` computes it, with VAPO's decoupled and length-adaptive lambda.

Inputs are ``[B, S]`` and aligned like logprobs (design.md §2.2): ``values[:, i]`` is V of the state in which token
``i`` is chosen, ``token_rewards[:, i]`` the reward for choosing it
(:func:`rlcore.algorithms.ppo.rewards.token_rewards`: the sequence reward on the last generated token, plus any
per-token terms), ``mask`` the generated tokens that count (``token_mask * sample_mask`` at positions ``1..S-1``,
:func:`rlcore.algorithms.utils.valid_token_mask`: the loss's valid tokens). Over the tokens of the mask, backwards::

    delta_t = r_t + gamma * V_next - V_t         V_next: the value at the next generated token, 0 after the last
    A_t = delta_t + gamma * lambda * A_next

**Masked spans are skipped.** A token off the mask (the prompt, padding, the environment's tokens between two
turns of a multi-turn rollout) is not a step: the last generated token before a span bootstraps from the first one
after it, undiscounted by the span's length, and a reward or value written on the span is never read (NeMo-RL's
carry-forward masking). Advantages and returns are 0 off the mask.

Computed in float64 (a reverse scan over the longest row's generated tokens); returned as float32, what the losses
read. Importing this module does not import torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import torch

    from rlcore.algorithms.grpo.loss_config import ClippedPGLossConfig
    from rlcore.algorithms.ppo.config import GAEConfig

#: Added to the variance before whitening (NeMo-RL's ``_reward_whiten``).
WHITEN_EPS = 1e-8


class Advantages(NamedTuple):
    """What :func:`ppo_advantages` gives a step: both ``[B, S]`` float32, 0 off the mask."""

    advantages: torch.Tensor  #: the policy's (lambda_policy, whitened with normalize_advantages)
    returns: torch.Tensor  #: the critic's targets: GAE with lambda_value plus the values


def generalized_advantages(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float | torch.Tensor,
) -> torch.Tensor:
    """GAE advantages ``[B, S]`` float64 (module docstring), 0 off ``mask``; ``lam`` a float or one per row
    (``[B]``). ``returns = advantages + values`` on the mask."""
    import torch

    valid = torch.as_tensor(mask, device=values.device) != 0
    rows = valid.shape[0]
    # The generated tokens of each row moved to its front, in order: the scan then steps over masked spans.
    order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)
    counts = valid.sum(dim=1)
    length = int(counts.max()) if counts.numel() else 0
    index = order[:, :length]
    packed_valid = torch.arange(length, device=values.device)[None, :] < counts[:, None]
    zero = torch.zeros((), dtype=torch.float64, device=values.device)
    r = torch.where(packed_valid, token_rewards.to(torch.float64).gather(1, index), zero)
    v = torch.where(packed_valid, values.to(torch.float64).gather(1, index), zero)
    discount = gamma * torch.as_tensor(lam, dtype=torch.float64, device=values.device).expand(rows)
    packed = torch.zeros_like(v)
    next_value = torch.zeros(rows, dtype=torch.float64, device=values.device)
    next_advantage = torch.zeros_like(next_value)
    for t in range(length - 1, -1, -1):  # past a row's last token r = v = 0, so its next value/advantage stay 0
        next_advantage = r[:, t] + gamma * next_value - v[:, t] + discount * next_advantage
        next_advantage = torch.where(packed_valid[:, t], next_advantage, zero)
        packed[:, t] = next_advantage
        next_value = v[:, t]
    out = torch.zeros(valid.shape, dtype=torch.float64, device=values.device)
    return out.scatter(1, index, packed)


def policy_lambda(cfg: GAEConfig, mask: torch.Tensor) -> float | torch.Tensor:
    """The policy's lambda: per row ``clamp(1 - 1 / max(alpha * l, 1), 0, 1)`` with ``l`` the row's tokens on
    ``mask`` when ``length_adaptive_alpha`` > 0 (a row with ``alpha * l <= 1`` gets 0), else ``gae_lambda_policy``,
    else ``gae_lambda`` (NeMo-RL's order)."""
    import torch

    if cfg.length_adaptive_alpha > 0:
        lengths = (torch.as_tensor(mask) != 0).sum(dim=1).to(torch.float64)
        return (1.0 - 1.0 / (cfg.length_adaptive_alpha * lengths).clamp(min=1.0)).clamp(0.0, 1.0)
    return cfg.gae_lambda if cfg.gae_lambda_policy is None else cfg.gae_lambda_policy


def whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(values - mean) / sqrt(var + 1e-8)`` with the mean and unbiased variance over the tokens of ``mask``
    (each token weighs the same, so long completions weigh more); 0 off the mask. With fewer than 2 tokens the
    variance is taken as 0 (NeMo-RL's would be NaN)."""
    import torch

    valid = torch.as_tensor(mask, device=values.device) != 0
    x = values.to(torch.float64)
    n = int(valid.sum())
    zero = torch.zeros((), dtype=torch.float64, device=values.device)
    mean = torch.where(valid, x, zero).sum() / max(n, 1)
    centred = torch.where(valid, x - mean, zero)
    var = centred.square().sum() / (n - 1) if n > 1 else zero
    return (centred * torch.rsqrt(var + WHITEN_EPS)).to(values.dtype)


def ppo_advantages(cfg: GAEConfig, token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> Advantages:
    """The step's advantages and returns (``ppo.adv_estimator``): the returns from GAE with the critic's lambda
    plus ``values``, the advantages from GAE with the policy's lambda (one pass when the two are the same),
    whitened over ``mask`` with ``normalize_advantages``. All of the step's rollout at once: the whitening
    statistics are the batch's."""
    import torch

    valid = torch.as_tensor(mask, device=values.device) != 0
    value_advantages = generalized_advantages(token_rewards, values, valid, cfg.gae_gamma, cfg.lambda_value)
    returns = torch.where(valid, value_advantages + values.to(torch.float64), 0.0)
    advantages = value_advantages
    if cfg.decoupled:
        advantages = generalized_advantages(token_rewards, values, valid, cfg.gae_gamma, policy_lambda(cfg, valid))
    if cfg.normalize_advantages:
        advantages = whiten(advantages, valid)
    return Advantages(advantages.to(torch.float32), returns.to(torch.float32))


def batch_advantages(
    cfg: GAEConfig, loss_cfg: ClippedPGLossConfig, data: Mapping[str, Any], rewards: torch.Tensor
) -> Advantages:
    """A step's advantages and returns from its training batch: ``rewards [B]`` (after GRPO's
    :func:`~rlcore.algorithms.grpo.reward_transforms.transform_rewards` on the ``ppo`` section) on each row's last
    valid token, minus the KL per token with ``loss.use_kl_in_reward``
    (:func:`~rlcore.algorithms.ppo.rewards.kl_reward`), GAE over ``data['values']`` (the critic's, aligned like
    logprobs) on the loss's valid tokens (``token_mask * sample_mask`` at ``1..S-1``)."""
    import torch

    from rlcore.algorithms.ppo.rewards import kl_reward, token_rewards
    from rlcore.algorithms.utils import valid_token_mask

    if data.get("values") is None:
        raise KeyError("PPO's advantages need data['values'], the critic's values of the batch (get_values)")
    mask = valid_token_mask(data, device=rewards.device)
    values = torch.as_tensor(data["values"], device=rewards.device)
    return ppo_advantages(cfg, token_rewards(rewards, mask, kl_reward(loss_cfg, data)), values, mask)


__all__ = ["Advantages", "batch_advantages", "generalized_advantages", "policy_lambda", "ppo_advantages", "whiten"]
