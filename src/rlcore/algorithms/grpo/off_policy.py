"""Off-policy correction for the gap between the inference engine and the trainer.

The rollout's tokens were sampled by the engine (``generation_logprobs``); the loss trains the trainer's copy of
the same weights (``prev_logprobs``, the trainer's logprobs of the parameters that sampled the rollout). Kernels,
numerics and MoE routing make the two differ. This module holds the importance weights that correct for it
(:func:`truncated_importance_weights`, one mode per ``loss.truncated_importance_sampling_type``) and the metrics
that measure the gap (:func:`engine_gap_metrics`, :func:`probs_pearson`).

A *sequence* is one sample's valid tokens: ``token_mask * sample_mask`` at positions ``1..S-1``. In a
multi-turn sample those are the generated tokens of every turn; the prompt, the environment's and the tools'
tokens have ``token_mask`` 0 and take no part in any sum, mean or bound here.

Importing this module does not import torch.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from rlcore.algorithms.utils import normaliser, zero_off_mask

if TYPE_CHECKING:
    import torch

    from rlcore.algorithms.grpo.loss_config import ClippedPGLossConfig

__all__ = [
    "ENGINE_GAP_METRICS",
    "PEARSON_MOMENTS",
    "PEARSON_NAME",
    "SEQUENCE_LEVEL_TYPES",
    "engine_gap_metrics",
    "probs_pearson",
    "truncated_importance_weights",
]

#: Truncation types that decide per sequence (``is_oob_ratio`` is then a fraction of sequences).
SEQUENCE_LEVEL_TYPES = ("seq-mask-tis", "seq-tis", "geo-mask")

#: The gap's step metrics that the loss reports as they are (verl's names).
ENGINE_GAP_METRICS = ("rollout_probs_diff_mean", "rollout_probs_diff_max", "k3_kl")

#: verl's name for the Pearson correlation of the engine's and the trainer's token probabilities.
PEARSON_NAME = "rollout_actor_probs_pearson_corr"

#: The loss's token means that :func:`probs_pearson` needs: E[p_train], E[p_engine], E[p_train^2],
#: E[p_engine^2], E[p_train * p_engine]. A correlation is not a sum of micro-batch shares, these means are.
PEARSON_MOMENTS = (
    "rollout_probs_train_mean",
    "rollout_probs_engine_mean",
    "rollout_probs_train_sq_mean",
    "rollout_probs_engine_sq_mean",
    "rollout_probs_product_mean",
)


def _log_bound(bound: float) -> float:
    return -math.inf if bound == 0 else math.log(bound)


def truncated_importance_weights(
    prev: torch.Tensor, gen: torch.Tensor, mask: torch.Tensor, cfg: ClippedPGLossConfig
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weight ``[B, S]`` that multiplies each token's actor loss, and where the bounds were exceeded
    (``[B, S]`` per token, ``[B]`` per sequence for :data:`SEQUENCE_LEVEL_TYPES`, None without bounds).

    ``prev`` and ``gen`` are 0 off ``mask``. The raw weight is ``pi_prev / pi_generation`` per token, or with
    GSPO (``sequence_level_importance_ratios``) ``exp(sum_t log pi_prev - log pi_generation)`` per sequence;
    a weight that is not finite counts as 0 (NeMo-RL's semantics). Then, by type:

    - ``tis``: clamped to ``[ratio_min or 0, ratio]``;
    - ``icepop``: 0 where outside ``[ratio_min, ratio]``;
    - ``seq-mask-tis``: 0 for sequences whose geometric-mean token weight is outside ``[ratio_min, ratio]``,
      the raw token weights elsewhere;
    - ``seq-tis``: one weight per sequence, ``exp(sum_t log pi_prev - log pi_generation)`` truncated to
      ``[ratio_min or 0, ratio]``; the truncation is done on the log-weight, so a sum too large for ``exp`` in
      the logprobs' dtype still truncates to ``ratio`` (a NaN or +inf sum counts as weight 0);
    - ``geo-mask``: no reweighting: 1 for sequences whose geometric-mean token weight
      ``exp(mean_t log pi_prev - log pi_generation)`` lies in ``[ratio_min, ratio]``, 0 for the others (NaN too).
    """
    import torch

    kind = cfg.truncated_importance_sampling_type
    low, high = cfg.truncated_importance_sampling_ratio_min, cfg.truncated_importance_sampling_ratio
    log_weight = prev - gen  # 0 off the mask
    if kind in ("seq-tis", "geo-mask") and (high is None or (kind == "geo-mask" and low is None)):
        raise ValueError(f"truncated_importance_sampling_type={kind!r} needs its bounds, got [{low}, {high}]")
    if kind == "seq-tis" and high is not None:
        return _sequence_truncated_weights(log_weight, 0.0 if low is None else low, high)
    if kind == "geo-mask" and low is not None and high is not None:
        keep = _geometric_mean_in_bounds(log_weight, mask, low, high)
        return keep.unsqueeze(-1).to(log_weight.dtype).expand_as(log_weight), ~keep
    if cfg.sequence_level_importance_ratios:
        log_weight = log_weight.sum(-1, keepdim=True).expand_as(log_weight)
    weight = torch.nan_to_num(torch.exp(log_weight), nan=0.0, posinf=0.0, neginf=0.0)
    if high is None:
        return weight, None
    if kind == "tis":
        low = 0.0 if low is None else low
        return weight.clamp(low, high), (weight < low) | (weight > high)
    if kind == "icepop" and low is not None:
        keep = (weight >= low) & (weight <= high)
        return torch.where(keep, weight, torch.zeros_like(weight)), ~keep
    if kind == "seq-mask-tis" and low is not None:
        # exp-space comparison, as NeMo-RL's: a NaN or overflowing geometric mean drops the sequence
        tokens_per_seq = mask.sum(-1).clamp_min(1).to(prev.dtype)
        geo_mean = torch.exp(log_weight.sum(-1) / tokens_per_seq)
        keep_seq = (geo_mean >= low) & (geo_mean <= high)
        return weight * keep_seq.unsqueeze(-1).to(weight.dtype), ~keep_seq
    raise ValueError(f"truncated_importance_sampling_type={kind!r} with bounds [{low}, {high}]")  # the config refuses


def _sequence_truncated_weights(log_weight: torch.Tensor, low: float, high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """seq-tis: ``clamp(exp(sum_t log_weight), low, high)`` per sequence, broadcast to its tokens."""
    import torch

    log_seq = log_weight.sum(-1)
    # a non-finite weight counts as 0, i.e. log-weight -inf; a finite overflow is not non-finite
    log_seq = torch.where(torch.isnan(log_seq) | (log_seq == math.inf), -math.inf, log_seq)
    log_low, log_high = _log_bound(low), _log_bound(high)
    weight = torch.exp(log_seq.clamp(max=log_high)).clamp_min(low)
    out_of_bounds = (log_seq < log_low) | (log_seq > log_high)
    return weight.unsqueeze(-1).expand_as(log_weight), out_of_bounds


def _geometric_mean_in_bounds(log_weight: torch.Tensor, mask: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """geo-mask: ``[B]`` whether ``exp(mean over the sequence's valid tokens of log_weight)`` is in bounds
    (compared in log space; NaN is not)."""
    tokens_per_seq = mask.sum(-1).clamp_min(1).to(log_weight.dtype)
    log_geo_mean = log_weight.sum(-1) / tokens_per_seq
    return (log_geo_mean >= _log_bound(low)) & (log_geo_mean <= _log_bound(high))


def engine_gap_metrics(
    prev: torch.Tensor, gen: torch.Tensor, mask: torch.Tensor, global_valid_toks: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The engine/trainer gap over valid tokens, in float64, each this micro-batch's share of the step's token
    mean (divided by ``global_valid_toks``, as ``token_mult_prob_error`` is), except the ``_max``, an extreme
    over this micro-batch's valid tokens (-inf without any). With ``p_train = exp(prev)`` and
    ``p_engine = exp(gen)``, the probabilities of the sampled tokens:

    - ``rollout_probs_diff_mean`` / ``rollout_probs_diff_max``: mean / max of ``|p_train - p_engine|`` (verl's);
    - ``k3_kl``: k3 estimate of ``KL(engine || trainer)`` from the engine's samples, ``r - 1 - log r`` with
      ``r = p_train / p_engine`` (verl's ``rollout_corr/k3_kl``; ``gen_kl_error`` with ``k3``, whatever
      ``reference_policy_kl_type`` is);
    - :data:`PEARSON_MOMENTS`, from which :func:`probs_pearson` gives the step's Pearson correlation.
    """
    import torch

    prev64, gen64 = prev.detach().to(torch.float64), gen.detach().to(torch.float64)
    p_train, p_engine = torch.exp(prev64), torch.exp(gen64)
    log_ratio = prev64 - gen64
    diff = (p_train - p_engine).abs()
    count = normaliser(global_valid_toks, prev64)

    def token_mean(per_token: torch.Tensor) -> torch.Tensor:
        return zero_off_mask(per_token, mask).sum() / count

    valid_diff = diff[mask]
    diff_max = valid_diff.max() if valid_diff.numel() else torch.tensor(-math.inf, dtype=torch.float64)
    moments = (p_train, p_engine, p_train.square(), p_engine.square(), p_train * p_engine)
    return {
        "rollout_probs_diff_mean": token_mean(diff),
        "rollout_probs_diff_max": diff_max.to(prev64.device),
        "k3_kl": token_mean(torch.expm1(log_ratio) - log_ratio),
        **{name: token_mean(value) for name, value in zip(PEARSON_MOMENTS, moments, strict=True)},
    }


def probs_pearson(step_metrics: dict[str, float]) -> float:
    """Pearson correlation of ``p_train`` and ``p_engine`` over the step's valid tokens, from the step values
    of :data:`PEARSON_MOMENTS` (a train call of several optimizer steps weighs each step's tokens alike, as its
    other token means do); NaN without them or when either side has no variance."""
    if not all(name in step_metrics for name in PEARSON_MOMENTS):
        return math.nan
    mean_t, mean_e, sq_t, sq_e, product = (float(step_metrics[name]) for name in PEARSON_MOMENTS)
    var_t, var_e = sq_t - mean_t * mean_t, sq_e - mean_e * mean_e
    if not (var_t > 0 and var_e > 0):
        return math.nan
    return max(-1.0, min(1.0, (product - mean_t * mean_e) / math.sqrt(var_t * var_e)))
