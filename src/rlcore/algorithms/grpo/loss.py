"""GRPO's loss: the clipped policy gradient of the PPO/GRPO family (NLL, SFT's, is :mod:`rlcore.algorithms.sft.loss`).

It (like every rlcore loss) implements :class:`rlcore.interfaces.loss.LossFunction`: they are called once
per micro-batch with the current policy's token logprobs ``[B, S]`` and the
numbers of valid sequences / tokens of the *whole optimizer step on all dp
ranks*, and return this micro-batch's share of the step loss.

Aggregation convention (losses *and* metrics)
---------------------------------------------
Every value is divided by a global normaliser, never by a micro-batch count, so
the caller **sums** it over micro-batches and dp ranks to get the step value
(:func:`rlcore.interfaces.loss.step_metrics`):

- ``loss``, ``actor_loss``, ``kl_loss`` (the beta-scaled KL term) and
  ``kl_penalty`` (the KL estimate itself, ``kl_loss / beta``, NeMo-RL's meaning
  of the name) use the loss's own normalisation (per valid token, or per valid
  sequence for sequence-level losses) and ``loss == actor_loss + kl_loss``;
- token diagnostics are means over valid tokens, i.e. divided by
  ``global_valid_toks``, whatever the loss type: ``probs_ratio`` and
  ``probs_ratio_clamped`` (in REINFORCE mode, which has no ratio, both are
  ``log pi``, NeMo-RL's value under that name; 1 with ``force_on_policy_ratio``),
  ``clip_fraction`` (not in REINFORCE mode), ``approx_entropy``, and where both ``prev_logprobs`` and
  ``generation_logprobs`` are given ``token_mult_prob_error``, ``gen_kl_error``,
  ``policy_kl_error``, ``js_divergence_error``, the engine/trainer gap of
  :func:`~rlcore.algorithms.grpo.off_policy.engine_gap_metrics` (``rollout_probs_diff_mean``, ``k3_kl``
  and the moments of ``rollout_actor_probs_pearson_corr``), ``sampling_importance_ratio``
  (per sequence with GSPO, seq-tis and geo-mask) and, with truncation bounds, ``is_oob_ratio``
  (per sequence with seq-mask-tis, seq-tis and geo-mask);
- names ending in ``_min`` / ``_max`` (``probs_ratio_min``, ``rollout_probs_diff_max``, ...) are extremes
  over this micro-batch's valid tokens (+inf / -inf without any), reduced with
  min / max;
- ``num_valid_tokens`` and ``num_valid_samples`` are raw counts of this
  micro-batch, not normalised. Summed, they give the step's counts.

Every name means what it means in NeMo-RL's ``ClippedPGLossFn``
(``docs/nemo-rl-mapping.md`` lists them); the engine/trainer gap's names are verl's.

Importing this module does not import torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from rlcore.algorithms.grpo.loss_config import ClippedPGLossConfig
from rlcore.algorithms.grpo.off_policy import engine_gap_metrics, truncated_importance_weights
from rlcore.algorithms.utils import (
    kl_estimate,
    masked_input,
    normalised_sum,
    normaliser,
    valid_token_mask,
    zero_off_mask,
)
from rlcore.interfaces.loss import LossType

if TYPE_CHECKING:
    import torch

__all__ = ["ClippedPGLossConfig", "ClippedPGLossFn", "positive_example_token_counts"]

#: Truncation types whose weight is one per sequence: ``sampling_importance_ratio`` is then a sequence mean.
ONE_PER_SEQUENCE = ("seq-tis", "geo-mask")


class ClippedPGLossFn:
    """Clipped policy-gradient loss: PPO / GRPO / DAPO / GSPO / CISPO / REINFORCE, plus KL to a reference.

    Per valid token, with ``A`` the advantage, ``r = pi / pi_prev`` and ``sg`` a stopped gradient::

        actor = max(-A * r, -A * clip(r, 1 - eps_low, 1 + eps_high))     # PPO
        actor = min(actor, c * |A|)            if A < 0 and ratio_clip_c    # dual clip
        actor = -A * sg(clip(r, ...)) * log pi if use_cispo                 # CISPO
        actor = -A * log pi                    if disable_ppo_ratio         # REINFORCE
        actor = w_is * actor                   if use_importance_sampling_correction
        token = actor + beta * clamp(w_kl * k(log pi_ref - log pi), +-kl_output_clamp_value)

    **Clipping** removes the incentive to move the ratio beyond the trust region
    in the direction the advantage pushes, so several steps on one batch stay
    close to the sampling policy. Separate low/high bounds (DAPO) let rare
    tokens gain probability faster than they lose it.

    **Dual clip**: for ``A < 0`` the PPO max keeps the unclipped ``-A * r`` when
    ``r`` is large, so one token that became much *more* likely (a stale or
    off-policy sample) contributes an unbounded loss and gradient. Capping it
    at ``c * |A|`` (c > 1 so it never binds inside the ordinary clip range)
    removes that token's gradient instead.

    **CISPO** clips the ratio only as a (gradient-free) weight of the REINFORCE
    term, so a token outside the trust region keeps a bounded gradient instead
    of none.

    **GSPO** (``sequence_level_importance_ratios``): ``r`` is the geometric mean
    of the sequence's token ratios, matching sequence-level rewards and
    reducing the variance of long sequences' token ratios.

    **VAPO** (``positive_example_nll_weight`` mu > 0) adds ``mu`` times the
    mean NLL of the step's tokens of completions with reward > 0.

    **Importance-sampling correction**: the data were sampled by the inference
    engine (``generation_logprobs``), not by the trainer's copy of the same
    weights (``prev_logprobs``); numerics, kernels or MoE routing make them
    differ. ``w_is = pi_prev / pi_generation`` (no gradient) reweights each
    token, or with GSPO each sequence, ``exp(sum_t (log pi_prev - log
    pi_generation))``; a non-finite weight counts as 0. ``tis`` clamps it to
    ``[ratio_min (default 0), ratio]`` to bound variance, ``icepop`` zeroes
    the tokens whose weight is outside ``[ratio_min, ratio]``, ``seq-mask-tis``
    zeroes the sequences whose geometric-mean weight is outside it and leaves
    the others' token weights as they are. ``seq-tis`` weighs every token of a
    sequence by the sequence's weight ``exp(sum_t (log pi_prev - log
    pi_generation))`` clamped to ``[ratio_min (default 0), ratio]``;
    ``geo-mask`` does not reweight, it leaves out of the loss the sequences whose
    geometric-mean weight is outside ``[ratio_min, ratio]`` (SkyRL's default
    after token TIS let the gap grow). See :mod:`rlcore.algorithms.grpo.off_policy`.

    **KL weight** ``w_kl``: the KL estimators are expectations under the
    current policy, ``KL(pi||pi_ref) = E_{x~pi}[k(x)]``, but ``x`` came from a
    sampler ``q``, so the term is ``E_q[(pi / q) * k]`` and its gradient must
    include the score-function part ``k * grad log pi`` (without it, k3's
    gradient would be that of the *forward* KL(pi_ref||pi)). So ``w_kl =
    pi / q`` keeps its gradient: with ``use_on_policy_kl_approximation`` ``q``
    is the inference engine (``generation_logprobs``, else ``prev_logprobs``);
    without it the samples are treated as on-policy and ``w_kl = exp(log pi -
    stopgrad(log pi))``, value 1 with that gradient. The clamps are those of
    :func:`~rlcore.algorithms.utils.kl_estimate`: a token whose log-ratio is
    clamped, or whose weighted estimate is, gets no gradient at all. The
    importance-sampling weight applies to the actor term only.

    Normalisation (``token_level_loss``) and metrics: see the module docstring.
    ``data`` needs ``token_mask``, ``sample_mask``, ``advantages`` and
    ``prev_logprobs`` (except in REINFORCE mode without IS correction);
    ``generation_logprobs`` with IS correction; ``reference_policy_logprobs``
    when ``reference_policy_kl_penalty > 0``. Only ``logprobs`` gets gradients.
    """

    def __init__(self, cfg: ClippedPGLossConfig | Mapping[str, Any] | None = None) -> None:
        if cfg is None:
            cfg = ClippedPGLossConfig()
        elif not isinstance(cfg, ClippedPGLossConfig):
            # A plain dict (NeMo-RL's loss_fn section shape): problems are ConfigError lines "loss.<key>: ...".
            from rlcore.config import ConfigError, validate_section

            model, problems = validate_section(ClippedPGLossConfig, cfg, "loss")
            if model is None:
                raise ConfigError(problems)
            cfg = model
        self.cfg = cfg
        self.loss_type = LossType.TOKEN_LEVEL if cfg.token_level_loss else LossType.SEQUENCE_LEVEL

    def __call__(
        self,
        logprobs: torch.Tensor,
        data: Mapping[str, Any],
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        import torch

        cfg = self.cfg
        mask = valid_token_mask(data, logprobs.device)
        # Off the mask everything is 0, so no padding value can reach a gradient.
        lp = zero_off_mask(logprobs, mask)

        def get(key: str, required: bool, why: str = "") -> torch.Tensor | None:
            value = masked_input(data, key, mask, lp)
            if value is None and required:
                raise KeyError(f"ClippedPGLossFn needs data[{key!r}]{why}")
            return value

        advantages = get("advantages", True)
        needs_prev = not cfg.disable_ppo_ratio or cfg.use_importance_sampling_correction
        # null is resolved with the run's config (rlcore.config.resolve); alone it means false
        prev = lp.detach() if cfg.force_on_policy_ratio else get("prev_logprobs", needs_prev)
        gen = get(
            "generation_logprobs",
            cfg.use_importance_sampling_correction,
            " when use_importance_sampling_correction is on",
        )
        beta = 0.0 if cfg.use_kl_in_reward else cfg.reference_policy_kl_penalty  # Reinforce++: in the advantages
        ref = get("reference_policy_logprobs", beta > 0, " when reference_policy_kl_penalty > 0")

        ratio = self._ratio(lp, prev, mask)
        clipped_ratio = ratio.clamp(1.0 - cfg.ratio_clip_min, 1.0 + cfg.ratio_clip_max)
        actor, clipped = self._actor(lp, advantages, ratio, clipped_ratio)
        is_weight, out_of_bounds = (
            truncated_importance_weights(prev, gen, mask, cfg) if gen is not None and prev is not None else (None, None)
        )
        if cfg.use_importance_sampling_correction:
            actor = actor * is_weight

        kl = torch.zeros_like(lp)
        if beta > 0:
            kl = kl_estimate(
                ref - lp,
                cfg.reference_policy_kl_type,
                cfg.kl_input_clamp_value,
                cfg.kl_output_clamp_value,
                weight=self._kl_weight(lp, prev, gen),
            )

        def reduce(per_token: torch.Tensor) -> torch.Tensor:
            return normalised_sum(per_token, mask, self.loss_type, global_valid_seqs, global_valid_toks)

        actor_loss = reduce(actor)
        kl_penalty = reduce(kl)
        kl_loss = beta * kl_penalty
        loss = actor_loss + kl_loss
        if cfg.positive_example_nll_weight > 0:
            positive_nll = positive_example_nll(lp, data, mask)
            loss = loss + cfg.positive_example_nll_weight * positive_nll

        with torch.no_grad():

            def token_mean(per_token: torch.Tensor) -> torch.Tensor:
                return normalised_sum(
                    per_token.to(lp.dtype), mask, LossType.TOKEN_LEVEL, global_valid_seqs, global_valid_toks
                )

            rows = sample_rows(data, mask)

            def sample_mean(per_row: torch.Tensor) -> torch.Tensor:
                return (per_row.to(lp.dtype) * rows.to(lp.dtype)).sum() / normaliser(global_valid_seqs, lp)

            named = {"loss": loss, "actor_loss": actor_loss, "kl_loss": kl_loss, "kl_penalty": kl_penalty}
            if cfg.disable_ppo_ratio and not cfg.force_on_policy_ratio:
                # REINFORCE has no ratio; NeMo-RL reports log pi under these names, and so does rlcore
                ratio = clipped_ratio = lp
            named.update(probs_ratio=token_mean(ratio), probs_ratio_clamped=token_mean(clipped_ratio))
            if not cfg.disable_ppo_ratio:
                named.update(clip_fraction=token_mean(clipped))
            named.update(extremes("probs_ratio", ratio, mask))
            named.update(extremes("probs_ratio_clamped", clipped_ratio, mask))
            # Entropy of pi from the sampled tokens: E_q[(pi / q) * -log pi].
            behaviour = gen if gen is not None else prev
            entropy_weight = torch.exp(lp - behaviour) if behaviour is not None else torch.ones_like(lp)
            named["approx_entropy"] = token_mean(-entropy_weight * lp)
            if gen is not None and prev is not None:
                named.update(engine_mismatch(prev, gen, cfg.reference_policy_kl_type, token_mean))
                named.update(engine_gap_metrics(prev, gen, mask, global_valid_toks))
                if cfg.sequence_level_importance_ratios or cfg.truncated_importance_sampling_type in ONE_PER_SEQUENCE:
                    named["sampling_importance_ratio"] = sample_mean(is_weight[:, 0])
                else:
                    named["sampling_importance_ratio"] = token_mean(is_weight)
                if out_of_bounds is not None and out_of_bounds.dim() == 1:  # decided per sequence
                    named["is_oob_ratio"] = sample_mean(out_of_bounds)
                elif out_of_bounds is not None:
                    named["is_oob_ratio"] = token_mean(out_of_bounds)
            if cfg.positive_example_nll_weight > 0:
                named["positive_nll_loss"] = positive_nll
            named["num_valid_tokens"] = mask.sum()
            named["num_valid_samples"] = rows.sum()
            values = torch.stack([v.detach().to(torch.float64) for v in named.values()]).unbind()
        return loss, dict(zip(named, values))  # 0-dim float64 tensors: the training loop reads them once per step

    def _ratio(self, lp: torch.Tensor, prev: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor:
        """``pi / pi_prev`` per token, or with GSPO the geometric mean of its sequence's; 1 without prev."""
        import torch

        if prev is None:
            return torch.ones_like(lp)
        log_ratio = lp - prev
        if self.cfg.sequence_level_importance_ratios:
            tokens_per_seq = mask.sum(-1, keepdim=True).clamp_min(1).to(lp.dtype)
            log_ratio = (log_ratio.sum(-1, keepdim=True) / tokens_per_seq).expand_as(lp)
        return torch.exp(log_ratio)

    def _actor(
        self, lp: torch.Tensor, advantages: torch.Tensor, ratio: torch.Tensor, clipped_ratio: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token actor loss and where the clip bound it."""
        import torch

        cfg = self.cfg
        if cfg.disable_ppo_ratio:
            return -advantages * lp, torch.zeros_like(lp, dtype=torch.bool)
        if cfg.use_cispo:
            return -advantages * clipped_ratio.detach() * lp, clipped_ratio != ratio
        unclipped_loss = -advantages * ratio
        clipped_loss = -advantages * clipped_ratio
        actor = torch.maximum(unclipped_loss, clipped_loss)
        clipped = clipped_loss > unclipped_loss
        if cfg.ratio_clip_c is not None:
            bound = -advantages * cfg.ratio_clip_c  # = c * |A| where A < 0
            dual = (advantages < 0) & (actor > bound)
            actor = torch.where(dual, bound, actor)
            clipped = clipped | dual
        return actor, clipped

    def _kl_weight(self, lp: torch.Tensor, prev: torch.Tensor | None, gen: torch.Tensor | None) -> torch.Tensor:
        """``w_kl = pi / q``: value 1 with the score-function gradient, or pi / sampler (class docstring)."""
        import torch

        if not self.cfg.use_on_policy_kl_approximation:
            return torch.exp(lp - lp.detach())
        sampler = gen if gen is not None else prev
        if sampler is None:
            raise KeyError("use_on_policy_kl_approximation needs data['generation_logprobs'] or data['prev_logprobs']")
        return torch.nan_to_num(torch.exp(lp - sampler), nan=0.0, posinf=0.0, neginf=0.0)


def positive_example_nll(lp: torch.Tensor, data: Mapping[str, Any], mask: torch.Tensor) -> torch.Tensor:
    """VAPO's NLL over the valid tokens of completions with ``rewards > 0``: this micro-batch's share of their
    mean over the whole step, whose count each row carries in ``positive_example_token_count`` (see
    :func:`positive_example_token_counts`). NeMo-RL divides by the micro-batch's own count instead, which
    makes the step's loss depend on how it is cut into micro-batches."""
    import torch

    for key in ("rewards", "positive_example_token_count"):
        if data.get(key) is None:
            raise KeyError(
                f"ClippedPGLossFn needs data[{key!r}] when positive_example_nll_weight > 0 "
                "(rlcore.algorithms.grpo.loss.positive_example_token_counts fills the count)"
            )
    positive = torch.as_tensor(data["rewards"], device=lp.device) > 0
    count = torch.as_tensor(data["positive_example_token_count"], device=lp.device).to(lp.dtype)
    per_row = zero_off_mask(-lp, mask & positive[:, None]).sum(-1)
    return torch.where(count > 0, per_row / count.clamp_min(1), torch.zeros_like(per_row)).sum()


def positive_example_token_counts(
    token_mask: torch.Tensor, sample_mask: torch.Tensor, rewards: torch.Tensor, global_batch_size: int
) -> torch.Tensor:
    """``[B]``: for each row, the number of valid tokens (positions 1..S-1) of completions with reward > 0 in
    its optimizer step, the consecutive run of ``global_batch_size`` rows it belongs to."""
    import torch

    valid = (token_mask[:, 1:] != 0) & (sample_mask[:, None] != 0) & (rewards[:, None] > 0)
    per_step = valid.sum(-1).view(-1, global_batch_size).sum(-1, keepdim=True)
    return per_step.expand(-1, global_batch_size).reshape(-1).to(torch.float32)


def sample_rows(data: Mapping[str, Any], mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` 1.0 for the rows ``sample_mask`` keeps (all rows without one)."""
    import torch

    sample_mask = data.get("sample_mask")
    if sample_mask is None:
        return torch.ones(mask.shape[0], dtype=torch.float64, device=mask.device)
    return (torch.as_tensor(sample_mask, device=mask.device) != 0).to(torch.float64)


def extremes(name: str, values: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """``<name>_min`` / ``<name>_max`` over valid tokens; +inf / -inf when there are none."""
    import torch

    valid = values[mask]
    if valid.numel() == 0:
        empty = torch.tensor(float("inf"), device=values.device)
        return {f"{name}_min": empty, f"{name}_max": -empty}
    return {f"{name}_min": valid.min(), f"{name}_max": valid.max()}


def engine_mismatch(prev: torch.Tensor, gen: torch.Tensor, kl_type: str, token_mean: Any) -> dict[str, torch.Tensor]:
    """How far the trainer's logprobs (``prev``) are from the engine's (``gen``), means over valid tokens:
    ``token_mult_prob_error`` = exp|gen - prev|, ``gen_kl_error`` = KL(pi_gen || pi_train) and
    ``policy_kl_error`` = KL(pi_train || pi_gen) with the loss's estimator (no clamps), and the
    Jensen-Shannon estimate ``js_divergence_error``."""
    import math

    import torch

    log_mixture = torch.logaddexp(prev, gen) - math.log(2.0)

    def k3(log_p: torch.Tensor) -> torch.Tensor:
        return torch.exp(log_p - log_mixture) - (log_p - log_mixture) - 1.0

    return {
        "token_mult_prob_error": token_mean(torch.exp((gen - prev).abs())),
        "gen_kl_error": token_mean(kl_estimate(prev - gen, kl_type)),
        "policy_kl_error": token_mean(kl_estimate(gen - prev, kl_type)),
        "js_divergence_error": token_mean(0.5 * k3(prev) + 0.5 * k3(gen)),
    }
