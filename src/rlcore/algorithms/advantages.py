"""Group-relative advantages for GRPO: each completion is judged against its prompt's group."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def group_advantages(rewards: "torch.Tensor", group_size: int, estimator: str = "leave_one_out",
                     eps: float = 1e-6) -> "torch.Tensor":
    """Advantages for ``rewards [B]`` where consecutive runs of ``group_size`` share a prompt.

    - ``leave_one_out``: ``r_i - mean(r_j, j != i)``; unbiased and needs no std.
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
    elif estimator == "mean_std":
        std = groups.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(groups[:, :1])
        adv = (groups - groups.mean(dim=1, keepdim=True)) / (std + eps)
    else:
        raise ValueError(f"unknown advantage estimator {estimator!r}")
    return adv.reshape(-1).float()
