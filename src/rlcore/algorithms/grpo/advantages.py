"""Advantages: group-relative ones for GRPO (each completion judged against its prompt's group), GDPO's (the
same for each named reward, then combined), and Reinforce++'s token-level ones, whitened over the whole batch."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def group_advantages(
    rewards: torch.Tensor, group_size: int, estimator: str = "leave_one_out", eps: float = 1e-6
) -> torch.Tensor:
    """Advantages for ``rewards [B]`` where consecutive runs of ``group_size`` share a prompt.

    - ``leave_one_out``: ``r_i - mean(r_j, j != i)``; unbiased and needs no std.
    - ``leave_one_out_std``: the same, divided by ``std(r_j, j != i) + eps`` (unbiased std of the
      others) where that std is > 0: NeMo-RL's GRPO default (``use_leave_one_out_baseline`` and
      ``normalize_rewards``).
    - ``mean``: ``r_i - mean`` (NeMo-RL with neither option).
    - ``mean_std``: ``(r_i - mean) / (std + eps)`` with the group's (unbiased) std.
    """
    return _group_advantages64(rewards, group_size, estimator, eps).float()


def _group_advantages64(rewards: torch.Tensor, group_size: int, estimator: str, eps: float) -> torch.Tensor:
    """:func:`group_advantages` in float64."""
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
    return adv.reshape(-1)


def calculate_baseline_and_std_per_prompt(
    prompts: torch.Tensor,
    rewards: torch.Tensor,
    valid_mask: torch.Tensor,
    leave_one_out_baseline: bool = True,
    std_rewards: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample baseline and std ``[B]`` over the samples with the same prompt, NeMo-RL's function of this name.

    ``prompts [B, S]``: samples whose rows are identical share a prompt, wherever they are in the batch (unlike
    :func:`group_advantages`, which takes consecutive runs). Only samples with ``valid_mask [B]`` 1 count. With
    ``n`` the number of counted samples (minus the sample itself with ``leave_one_out_baseline``, the RLOO
    baseline), the baseline is the mean of their ``rewards`` and the std the unbiased std of their
    ``std_rewards`` (default ``rewards``; DAPO takes the std of another reward). A prompt with at most one valid
    sample gets its own rewards as baseline (advantage 0) and std 0; the std is also 0 where ``n <= 1`` or
    rounding makes the variance negative. Both come back in the dtype and on the device of ``rewards``.
    """
    import torch

    std_rewards = rewards if std_rewards is None else std_rewards
    _, group = torch.unique(prompts, dim=0, return_inverse=True)
    group = group.to(rewards.device)
    r, s = rewards.double(), std_rewards.to(rewards.device).double()
    valid = (torch.as_tensor(valid_mask, device=rewards.device) != 0).double()

    def per_group(values: torch.Tensor) -> torch.Tensor:
        """The sum of ``values`` over each sample's group, minus its own with the leave-one-out baseline."""
        totals = torch.zeros(
            int(group.max()) + 1 if group.numel() else 0, dtype=torch.float64, device=values.device
        ).index_add_(0, group, values)
        return totals[group] - values if leave_one_out_baseline else totals[group]

    valid_in_group = per_group(valid) + (valid if leave_one_out_baseline else 0.0)  # the whole group's count
    n = valid_in_group - float(leave_one_out_baseline)
    scored = valid_in_group > 1
    safe_n = torch.where(n > 0, n, torch.ones_like(n))
    baseline = torch.where(scored, per_group(r * valid) / safe_n, r)
    mean, mean_sq = per_group(s * valid) / safe_n, per_group(s * s * valid) / safe_n
    variance = (mean_sq - mean.square()) * n / torch.where(n > 1, n - 1, torch.ones_like(n))
    std = torch.where(scored & (n > 1), variance.clamp_min(0).sqrt(), torch.zeros_like(variance))
    return baseline.to(rewards.dtype), std.to(rewards.dtype)


def gdpo_advantages(
    components: dict[str, torch.Tensor],
    group_size: int,
    leave_one_out: bool = False,
    normalize: bool = True,
    weights: list[float] | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GDPO (https://arxiv.org/abs/2601.05242) advantages ``[B]`` from named rewards ``{name: [B]}``, as NeMo-RL's
    ``GDPOAdvantageEstimator`` computes them.

    Each component gets its own group advantage (:func:`group_advantages`): its reward minus its group's
    baseline (the others' mean with ``leave_one_out``, else the group mean), divided by the std + ``eps`` (the
    others' with ``leave_one_out``; unbiased) where that std is > 0 with ``normalize``. A group whose component
    is constant gives exactly 0 there, not the rounding noise the last step would blow up. The components,
    sorted by name, are summed with ``weights`` (in that order; default 1 each), and the sum is standardized
    over the whole batch: ``(a - mean) / std`` with the unbiased std, or ``a - mean`` when that std is 0
    (no eps: NeMo-RL's code, whatever its docs' formula says).
    """
    import torch

    names = sorted(components)
    if len(names) < 2:
        raise ValueError(f"GDPO needs at least 2 reward components, got {len(names)}: {names}")
    weights = [1.0] * len(names) if weights is None else list(weights)
    if len(weights) != len(names):
        raise ValueError(f"GDPO: {len(weights)} reward weights for {len(names)} reward components {names}")
    estimator = ("leave_one_out" if leave_one_out else "mean") + ("_std" if normalize else "")
    total = torch.zeros(components[names[0]].numel(), dtype=torch.float64)
    for name, weight in zip(names, weights):
        rewards = components[name].double().reshape(-1)
        adv = _group_advantages64(rewards, group_size, estimator, eps)
        groups = rewards.view(-1, group_size)
        constant = (groups == groups[:, :1]).all(dim=1, keepdim=True).expand_as(groups).reshape(-1)
        total += weight * torch.where(constant, torch.zeros_like(adv), adv)
    centred = total - total.mean()
    std = total.std() if total.numel() > 1 else torch.zeros((), dtype=torch.float64)
    return (centred / std if std > 0 else centred).float()


def reinforce_plus_plus_advantages(
    rewards: torch.Tensor,
    group_size: int,
    mask: torch.Tensor,
    minus_baseline: bool,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> torch.Tensor:
    """Reinforce++ (https://arxiv.org/abs/2501.03262) advantages ``[B, S]``, NeMo-RL's estimator.

    Every token of completion ``i`` starts from its reward ``r_i`` (minus its prompt group's mean with
    ``minus_baseline``: Reinforce++-baseline), minus ``kl_coef * kl`` at that token when the KL is in the
    reward (``kl`` per token, ``[B, S]``); then all valid tokens of the batch (``mask``) are whitened
    together: ``(a - mean) / sqrt(max(var, 1e-8))``, with the population variance. Off the mask it is 0.
    """

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


def override_flagged_tokens(
    advantages: torch.Tensor, flagged: torch.Tensor, token_mask: torch.Tensor, value: float
) -> torch.Tensor:
    """``advantages [B, T]`` with each trained token (``token_mask``) under ``flagged [B, T]`` set to ``value``.

    NeMo-RL's ``_apply_message_level_advantage_penalties``: the token span of each assistant message flagged as an
    invalid tool call gets the configured advantage in place of the computed one; the rollout's
    ``invalid_tool_call_mask`` marks exactly the generated tokens of the flagged turns.
    """
    import torch

    hit = flagged.to(torch.bool) & (token_mask != 0)
    return torch.where(hit, torch.full_like(advantages, value), advantages)


def count_spans(mask: torch.Tensor) -> int:
    """How many runs of consecutive nonzero entries the rows of ``mask [B, T]`` hold together: assistant turns
    in a ``token_mask`` (turns are separated by the tokens appended between them), flagged turns in an
    ``invalid_tool_call_mask``."""
    import torch

    on = mask != 0
    starts = on & ~torch.nn.functional.pad(on[:, :-1], (1, 0), value=False)
    return int(starts.sum())


__all__ = [
    "calculate_baseline_and_std_per_prompt",
    "count_spans",
    "override_flagged_tokens",
    "gdpo_advantages",
    "group_advantages",
    "reinforce_plus_plus_advantages",
]
