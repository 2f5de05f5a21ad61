"""Group-relative advantages for GRPO: each completion is judged against its prompt's group."""

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
