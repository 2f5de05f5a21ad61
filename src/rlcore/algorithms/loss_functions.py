"""Loss functions for RL post-training: clipped policy gradient (PPO/GRPO family) and NLL (SFT).

Both implement :class:`rlcore.interfaces.loss.LossFunction`: they are called once
per micro-batch with the current policy's token logprobs ``[B, S]`` and the
numbers of valid sequences / tokens of the *whole optimizer step on all dp
ranks*, and return this micro-batch's share of the step loss.

Aggregation convention (losses *and* metrics)
---------------------------------------------
Every value is divided by a global normaliser, never by a micro-batch count, so
the caller **sums** it over micro-batches and dp ranks to get the step value:

- ``loss``, ``actor_loss``, ``kl_penalty`` use the loss's own normalisation
  (per valid token, or per valid sequence for sequence-level losses) and
  ``loss == actor_loss + kl_penalty``;
- token diagnostics (``probs_ratio``, ``probs_ratio_clamped``,
  ``clip_fraction``, ``approx_entropy``, ``token_mult_prob_error``, with importance
  sampling correction ``is_weight_mean`` and ``is_truncated_fraction``) are means
  over valid tokens, i.e. divided by ``global_valid_toks``, whatever the loss
  type;
- the one exception is ``num_valid_tokens``: a raw count of this micro-batch's
  valid tokens, not normalised. Summed, it gives the step's count.

Importing this module does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from rlcore.algorithms.utils import (
    kl_estimate,
    masked_input,
    normalised_sum,
    valid_token_mask,
    zero_off_mask,
)
from rlcore.config.loss import ClippedPGLossConfig
from rlcore.interfaces.loss import LossType

if TYPE_CHECKING:
    import torch

__all__ = ["ClippedPGLossConfig", "ClippedPGLossFn", "NLLLoss"]


class ClippedPGLossFn:
    """Clipped policy-gradient loss: PPO / GRPO / DAPO / GSPO / REINFORCE, plus KL to a reference.

    Per valid token, with ``A`` the advantage and ``r = pi / pi_prev``::

        actor = max(-A * r, -A * clip(r, 1 - eps_low, 1 + eps_high))     # PPO
        actor = min(actor, c * |A|)            if A < 0 and ratio_clip_c    # dual clip
        actor = -A * log pi                    if disable_ppo_ratio         # REINFORCE
        actor = w_is * actor                   if use_importance_sampling_correction
        token = actor + beta * w_kl * k(log pi_ref - log pi)

    **Clipping** removes the incentive to move the ratio beyond the trust region
    in the direction the advantage pushes, so several steps on one batch stay
    close to the sampling policy. Separate low/high bounds (DAPO) let rare
    tokens gain probability faster than they lose it.

    **Dual clip**: for ``A < 0`` the PPO max keeps the unclipped ``-A * r`` when
    ``r`` is large, so one token that became much *more* likely (a stale or
    off-policy sample) contributes an unbounded loss and gradient. Capping it
    at ``c * |A|`` (c > 1 so it never binds inside the ordinary clip range)
    removes that token's gradient instead.

    **GSPO** (``sequence_level_importance_ratios``): ``r`` is the geometric mean
    of the sequence's token ratios, matching sequence-level rewards and
    reducing the variance of long sequences' token ratios.

    **Importance-sampling correction**: the data were sampled by the inference
    engine (``generation_logprobs``), not by the trainer's copy of the same
    weights (``prev_logprobs``); numerics, kernels or MoE routing make them
    differ. ``w_is = pi_prev / pi_generation`` (no gradient) reweights each
    token; ``tis`` truncates it at ``truncated_importance_sampling_ratio`` to
    bound variance, ``icepop`` zeroes tokens whose weight is outside
    ``[ratio_min, ratio]`` (the mismatch there is too large to trust).

    **KL weight** ``w_kl``: the KL estimators are expectations under the
    current policy, ``KL(pi||pi_ref) = E_{x~pi}[k(x)]``, but ``x`` came from a
    sampler ``q``, so the term is ``E_q[(pi / q) * k]`` and its gradient must
    include the score-function part ``k * grad log pi`` (without it, k3's
    gradient would be that of the *forward* KL(pi_ref||pi)). So ``w_kl =
    pi / q`` keeps its gradient: with ``use_on_policy_kl_approximation`` ``q``
    is the inference engine (``generation_logprobs``, else ``prev_logprobs``);
    without it the samples are treated as on-policy and ``w_kl = exp(log pi -
    stopgrad(log pi))``, value 1 with that gradient. The importance-sampling
    weight applies to the actor term only.

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
        logprobs: "torch.Tensor",
        data: Mapping[str, Any],
        global_valid_seqs: "torch.Tensor",
        global_valid_toks: "torch.Tensor",
    ) -> tuple["torch.Tensor", dict[str, float]]:
        import torch

        cfg = self.cfg
        mask = valid_token_mask(data, logprobs.device)
        # Off the mask everything is 0, so no padding value can reach a gradient.
        lp = zero_off_mask(logprobs, mask)

        def get(key: str, required: bool, why: str = "") -> "torch.Tensor | None":
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
        beta = cfg.reference_policy_kl_penalty
        ref = get("reference_policy_logprobs", beta > 0, " when reference_policy_kl_penalty > 0")

        # Ratio pi / pi_prev, per token or (GSPO) per sequence.
        log_ratio = lp - prev if prev is not None else torch.zeros_like(lp)
        if cfg.sequence_level_importance_ratios:
            tokens_per_seq = mask.sum(-1, keepdim=True).clamp_min(1).to(lp.dtype)
            log_ratio = (log_ratio.sum(-1, keepdim=True) / tokens_per_seq).expand_as(lp)
        ratio = torch.exp(log_ratio)
        clipped_ratio = ratio.clamp(1.0 - cfg.ratio_clip_min, 1.0 + cfg.ratio_clip_max)

        if cfg.disable_ppo_ratio:
            actor = -advantages * lp
            clipped = torch.zeros_like(mask)
        else:
            unclipped_loss = -advantages * ratio
            clipped_loss = -advantages * clipped_ratio
            actor = torch.maximum(unclipped_loss, clipped_loss)
            clipped = clipped_loss > unclipped_loss
            if cfg.ratio_clip_c is not None:
                bound = -advantages * cfg.ratio_clip_c  # = c * |A| where A < 0
                dual = (advantages < 0) & (actor > bound)
                actor = torch.where(dual, bound, actor)
                clipped = clipped | dual

        is_weight = None
        if cfg.use_importance_sampling_correction:
            raw_is_weight = is_weight = torch.exp(prev - gen)
            high = cfg.truncated_importance_sampling_ratio
            if cfg.truncated_importance_sampling_type == "icepop":
                low = cfg.truncated_importance_sampling_ratio_min
                keep = (is_weight >= low) & (is_weight <= high)
                is_weight = torch.where(keep, is_weight, torch.zeros_like(is_weight))
            elif high is not None:
                is_weight = is_weight.clamp(max=high)
            actor = actor * is_weight

        if beta > 0:
            kl = kl_estimate(
                ref - lp, cfg.reference_policy_kl_type, cfg.kl_input_clamp_value, cfg.kl_output_clamp_value
            )
            if cfg.use_on_policy_kl_approximation:
                sampler = gen if gen is not None else prev
                if sampler is None:
                    raise KeyError(
                        "use_on_policy_kl_approximation needs data['generation_logprobs'] or data['prev_logprobs']"
                    )
                kl_weight = torch.exp(lp - sampler)
            else:
                kl_weight = torch.exp(lp - lp.detach())
            kl_term = beta * kl_weight * kl
        else:
            kl_term = torch.zeros_like(lp)

        def reduce(per_token: "torch.Tensor") -> "torch.Tensor":
            return normalised_sum(per_token, mask, self.loss_type, global_valid_seqs, global_valid_toks)

        actor_loss = reduce(actor)
        kl_loss = reduce(kl_term)
        loss = actor_loss + kl_loss

        with torch.no_grad():

            def token_mean(per_token: "torch.Tensor") -> "torch.Tensor":
                return normalised_sum(
                    per_token.to(lp.dtype), mask, LossType.TOKEN_LEVEL, global_valid_seqs, global_valid_toks
                )

            # Entropy of pi from the sampled tokens: E_q[(pi / q) * -log pi].
            behaviour = gen if gen is not None else prev
            entropy_weight = torch.exp(lp - behaviour) if behaviour is not None else torch.ones_like(lp)
            named = {
                "loss": loss,
                "actor_loss": actor_loss,
                "kl_penalty": kl_loss,
                "probs_ratio": token_mean(ratio),
                "probs_ratio_clamped": token_mean(clipped_ratio),
                "clip_fraction": token_mean(clipped),
                "approx_entropy": token_mean(-entropy_weight * lp),
            }
            if gen is not None and prev is not None:
                named["token_mult_prob_error"] = token_mean(torch.exp((gen - prev).abs()))
            if is_weight is not None:  # importance weights pi_prev / pi_generation, and how many were cut
                named["is_weight_mean"] = token_mean(is_weight)
                named["is_truncated_fraction"] = token_mean(is_weight != raw_is_weight)
            named["num_valid_tokens"] = mask.sum()
            values = torch.stack([v.detach().to(torch.float64) for v in named.values()]).tolist()
        return loss, dict(zip(named, values))


class NLLLoss:
    """Negative log-likelihood for SFT: mean over all valid tokens of the step of ``-log pi``.

    Token-level normalisation by ``global_valid_toks`` (see the module
    docstring). Metrics: ``loss`` and ``num_valid_tokens`` (a raw count).
    """

    loss_type = LossType.TOKEN_LEVEL

    def __call__(
        self,
        logprobs: "torch.Tensor",
        data: Mapping[str, Any],
        global_valid_seqs: "torch.Tensor",
        global_valid_toks: "torch.Tensor",
    ) -> tuple["torch.Tensor", dict[str, float]]:
        mask = valid_token_mask(data, logprobs.device)
        lp = zero_off_mask(logprobs, mask)
        loss = normalised_sum(-lp, mask, self.loss_type, global_valid_seqs, global_valid_toks)
        return loss, {"loss": float(loss.detach()), "num_valid_tokens": float(mask.sum())}
