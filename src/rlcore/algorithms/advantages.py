"""Advantages: group-relative ones for GRPO (each completion judged against its prompt's group), and
Reinforce++'s token-level ones, whitened over the whole batch."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def group_advantages(rewards: "torch.Tensor", group_size: int, estimator: str = "leave_one_out",
                     eps: float = 1e-6) -> "torch.Tensor":
    """Advantages for ``rewards [B]`` where consecutive runs of ``group_size`` share a prompt.

    - ``leave_one_out``: ``r_i - mean(r_j, j != i)``; unbiased and needs no std.
    - ``leave_one_out_std``: the same, divided by ``std(r_j, j != i) + eps`` (unbiased std of the
      others) where that std is > 0: NeMo-RL's GRPO default (``use_leave_one_out_baseline`` and
      ``normalize_rewards``).
    - ``mean``: ``r_i - mean`` (NeMo-RL with neither option).
    - ``mean_std``: ``(r_i - mean) / (std + eps)`` with the group's (unbiased) std.
    """
    import torch

    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards are not whole groups of {group_size}")
    groups = rewards.double().view(-1, group_size)
    if estimator == "leave_one_out":
        if group_size < 2:
            raise ValueError("leave_one_out needs at least 2 completions per prompt")
        others = (groups.sum(dim=1, keepdim=True) - groups) / (group_size - 1)
        adv = groups - others
    elif estimator == "leave_one_out_std":
        if group_size < 2:
            raise ValueError("leave_one_out_std needs at least 2 completions per prompt")
        n = group_size - 1  # the others
        mean = (groups.sum(dim=1, keepdim=True) - groups) / n
        mean_sq = ((groups**2).sum(dim=1, keepdim=True) - groups**2) / n
        var = ((mean_sq - mean**2) * (n / (n - 1))).clamp_min(0) if n > 1 else torch.zeros_like(groups)
        std = var.sqrt()
        adv = torch.where(std > 0, (groups - mean) / (std + eps), groups - mean)
    elif estimator == "mean":
        adv = groups - groups.mean(dim=1, keepdim=True)
    elif estimator == "mean_std":
        std = groups.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(groups[:, :1])
        adv = (groups - groups.mean(dim=1, keepdim=True)) / (std + eps)
    else:
        raise ValueError(f"unknown advantage estimator {estimator!r}")
    return adv.reshape(-1).float()


def reinforce_plus_plus_advantages(rewards: "torch.Tensor", group_size: int, mask: "torch.Tensor",
                                   minus_baseline: bool, kl: "torch.Tensor | None" = None,
                                   kl_coef: float = 0.0) -> "torch.Tensor":
    """Reinforce++ (https://arxiv.org/abs/2501.03262) advantages ``[B, S]``, NeMo-RL's estimator.

    Every token of completion ``i`` starts from its reward ``r_i`` (minus its prompt group's mean with
    ``minus_baseline``: Reinforce++-baseline), minus ``kl_coef * kl`` at that token when the KL is in the
    reward (``kl`` per token, ``[B, S]``); then all valid tokens of the batch (``mask``) are whitened
    together: ``(a - mean) / sqrt(max(var, 1e-8))``, with the population variance. Off the mask it is 0.
    """
    import torch

    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards are not whole groups of {group_size}")
    r = rewards.double()
    if minus_baseline:
        r = (r.view(-1, group_size) - r.view(-1, group_size).mean(dim=1, keepdim=True)).reshape(-1)
    mask = mask.double()
    adv = r[:, None].expand(mask.shape)
    if kl is not None:
        adv = adv - kl_coef * kl.double()
    count = mask.sum().clamp_min(1)
    mean = (adv * mask).sum() / count
    var = ((adv - mean).square() * mask).sum() / count
    return ((adv - mean) * var.clamp_min(1e-8).rsqrt() * mask).float()
