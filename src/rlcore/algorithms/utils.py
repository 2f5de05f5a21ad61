"""Token-level helpers shared by the loss functions.

Everything works on ``[B, S]`` tensors aligned as in design.md §2.2 (position
``i`` holds ``log p(token_i | tokens_<i)``, position 0 is never a target).
torch is imported inside the functions so that importing this module stays
light.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from rlcore.algorithms.grpo.loss_config import KLType
from rlcore.interfaces.loss import LossType

if TYPE_CHECKING:
    import torch


def valid_token_mask(data: Mapping[str, Any], device: Any = None) -> torch.Tensor:
    """Bool ``[B, S]``: ``token_mask * sample_mask`` restricted to positions ``1..S-1``.

    ``sample_mask`` is optional (all ones when absent). Position 0 is dropped
    because no logprob is defined for the first token.
    """
    import torch

    mask = torch.as_tensor(data["token_mask"], device=device) != 0
    sample_mask = data.get("sample_mask")
    if sample_mask is not None:
        mask = mask & (torch.as_tensor(sample_mask, device=device) != 0).unsqueeze(-1)
    mask = mask.clone()
    mask[:, 0] = False
    return mask


def zero_off_mask(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``values`` where ``mask`` is set, 0 elsewhere (gradient 0 there too, even for non-finite values)."""
    import torch

    return torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))


def masked_input(data: Mapping[str, Any], key: str, mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor | None:
    """``data[key]`` detached, cast like ``like`` and zeroed off the mask (None if absent).

    Zeroing matters: padding may hold anything (-inf logprobs, NaN advantages),
    and a non-finite value off the mask would turn ``0 * inf`` into NaN
    gradients even though the token does not count.
    """
    import torch

    value = data.get(key)
    if value is None:
        return None
    return zero_off_mask(torch.as_tensor(value, device=like.device).detach().to(like.dtype), mask)


def kl_estimate(
    log_ratio: torch.Tensor,
    kl_type: KLType,
    input_clamp: float | None = None,
    output_clamp: float | None = None,
    weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token estimate of ``KL(pi || pi_ref)`` from ``log_ratio = log pi_ref(x) - log pi(x)``, x ~ pi.

    Schulman's estimators (http://joschu.net/blog/kl-approx.html), with
    ``r = pi_ref / pi``:

    - ``k1 = -log r``: unbiased, but high variance and negative on many samples.
    - ``k2 = (log r)^2 / 2``: always >= 0 and low variance, but biased.
    - ``k3 = (r - 1) - log r``: unbiased *and* always >= 0 (``r - 1`` is a
      zero-mean control variate and ``log`` is concave), hence the default.

    ``weight`` (the sampling weight ``pi / q`` of the loss) multiplies the
    estimate. ``input_clamp`` bounds ``|log r|`` before the estimate (``exp``
    in k3 overflows on tokens the reference finds very unlikely), and a token
    it binds on keeps its weight's value but not its gradient, so the token
    gets no gradient at all; ``output_clamp`` bounds the *weighted* estimate,
    so a few outlier tokens cannot dominate the penalty, and a token it binds
    on gets no gradient either. (NeMo-RL's ``calculate_kl`` semantics.)
    """
    import torch

    if input_clamp is not None:
        clamped = log_ratio.clamp(-input_clamp, input_clamp)
        if weight is not None:
            weight = torch.where(clamped == log_ratio, weight, weight.detach())
        log_ratio = clamped
    if kl_type == "k1":
        kl = -log_ratio
    elif kl_type == "k2":
        kl = 0.5 * log_ratio.square()
    elif kl_type == "k3":
        kl = torch.expm1(log_ratio) - log_ratio
    else:
        raise ValueError(f"unknown KL type {kl_type!r}; expected 'k1', 'k2' or 'k3'")
    if weight is not None:
        kl = weight * kl
    if output_clamp is not None:
        kl = kl.clamp(-output_clamp, output_clamp)
    return kl


def normaliser(value: Any, like: torch.Tensor) -> torch.Tensor:
    """A global count as a tensor like ``like``; 0 becomes 1 (then every numerator is 0 too)."""
    import torch

    n = torch.as_tensor(value, device=like.device).detach().to(like.dtype)
    return torch.where(n > 0, n, torch.ones_like(n))


def normalised_sum(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    loss_type: LossType,
    global_valid_seqs: Any,
    global_valid_toks: Any,
) -> torch.Tensor:
    """This micro-batch's share of a global mean of ``per_token`` over valid tokens.

    - token level: ``sum over valid tokens / global_valid_toks`` (every token
      weighs the same, whatever sequence it is in);
    - sequence level: ``sum over sequences of (mean over the sequence's valid
      tokens) / global_valid_seqs`` (every sequence weighs the same).

    Both are linear in the micro-batch's rows with a *global* denominator, so
    summing the results over micro-batches and dp ranks gives the whole-step
    value, which is design.md §2 contract 3.
    """
    per_token = zero_off_mask(per_token, mask)
    if LossType(loss_type) is LossType.TOKEN_LEVEL:
        return per_token.sum() / normaliser(global_valid_toks, per_token)
    tokens_per_seq = mask.sum(-1).clamp_min(1).to(per_token.dtype)
    return (per_token.sum(-1) / tokens_per_seq).sum() / normaliser(global_valid_seqs, per_token)


def masked_mean(
    values: torch.Tensor,
    mask: torch.Tensor,
    dim: int | None = None,
    global_normalization_factor: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """NeMo-RL's ``masked_mean``: ``sum(values * mask, dim) / sum(mask, dim)``, or divided by
    ``global_normalization_factor`` instead (a micro-batch's share of a global mean), over all elements with
    ``dim=None``.

    Two deliberate differences (docs/nemo-rl-semantics.md): the denominator is the count itself, not
    ``count + 1e-8``, and a denominator of 0 counts as 1 (a slice without a masked-in element gives 0);
    values off the mask are never read, so NaN or -inf padding there cannot make the mean NaN.
    """
    import torch

    weights = torch.as_tensor(mask, device=values.device).to(values.dtype)
    kept = torch.where(weights != 0, values * weights, torch.zeros((), dtype=values.dtype, device=values.device))
    total = kept.sum() if dim is None else kept.sum(dim)
    count = (
        (weights.sum() if dim is None else weights.sum(dim))
        if global_normalization_factor is None
        else global_normalization_factor
    )
    return total / normaliser(count, total)
