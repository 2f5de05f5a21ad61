"""The policy-gradient loss's settings: the top-level ``loss`` section, which GRPO owns (its spec's ``sections``),
the config of :class:`rlcore.algorithms.grpo.loss.ClippedPGLossFn`. Light: importing it never imports the loss."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rlcore.config.base import StrictModel

#: KL estimators: k1 (log-ratio), k2 (squared log-ratio / 2), k3 (unbiased, non-negative).
KLType = Literal["k1", "k2", "k3"]


class ClippedPGLossConfig(StrictModel):
    """Settings of :class:`rlcore.algorithms.grpo.loss.ClippedPGLossFn`; field names follow NeMo-RL's
    ``loss_fn`` section."""

    reference_policy_kl_penalty: float = Field(
        0.0, ge=0.0, description="Coefficient beta of the per-token KL(pi || pi_ref) penalty; 0 disables it."
    )
    reference_policy_kl_type: KLType = Field(
        "k3", description="KL estimator: k1 (log-ratio), k2 (squared log-ratio / 2) or k3 (unbiased, non-negative)."
    )
    kl_input_clamp_value: float | None = Field(
        20.0, gt=0.0, description="Bound on |log pi_ref - log pi| before the KL estimate; None: no bound."
    )
    kl_output_clamp_value: float | None = Field(
        10.0, gt=0.0, description="Bound on |per-token KL estimate|; None: no bound."
    )
    ratio_clip_min: float = Field(
        0.2, ge=0.0, lt=1.0, description="Lower clip: the ratio is clipped below at 1 - ratio_clip_min."
    )
    ratio_clip_max: float = Field(
        0.2,
        ge=0.0,
        description="Upper clip: the ratio is clipped above at 1 + ratio_clip_max (DAPO: > ratio_clip_min).",
    )
    ratio_clip_c: float | None = Field(
        None,
        gt=1.0,
        description="Dual-clip constant c > 1: a negative-advantage token's loss is at most c * |A|. None: off.",
    )
    positive_example_nll_weight: float = Field(
        0.0,
        ge=0.0,
        description="VAPO: weight mu of an NLL term over the tokens of completions with reward > 0, a mean over "
        "the step's such tokens (data['rewards'] and data['positive_example_token_count'], which the GRPO loop "
        "adds); 0 disables it.",
    )
    use_kl_in_reward: bool = Field(
        False,
        description="Reinforce++: subtract beta * KL(pi_prev || pi_ref) from each token's reward "
        "(grpo.advantage_estimator reinforce_plus_plus[_baseline]) instead of adding a KL term to the loss.",
    )
    use_on_policy_kl_approximation: bool = Field(
        False,
        description="Weight the KL estimate by pi / pi_sampler so it estimates KL of the current policy, "
        "not of the policy that sampled the data.",
    )
    use_importance_sampling_correction: bool = Field(
        False,
        description="Weight each token's actor loss by pi_prev / pi_generation to correct for "
        "trainer/inference-engine mismatch (needs generation_logprobs), truncated as "
        "truncated_importance_sampling_type says (geo-mask: a 0/1 weight per sequence).",
    )
    truncated_importance_sampling_ratio: float | None = Field(
        None,
        gt=0.0,
        description="Upper bound of the importance weight: tis and seq-tis truncate at it; icepop, seq-mask-tis "
        "and geo-mask keep what lies in [ratio_min, ratio]. null: no truncation.",
    )
    truncated_importance_sampling_ratio_min: float | None = Field(
        None,
        ge=0.0,
        description="Lower bound of the importance weight: tis and seq-tis raise weights below it to it "
        "(null: 0); icepop, seq-mask-tis and geo-mask need it.",
    )
    truncated_importance_sampling_type: Literal["tis", "icepop", "seq-mask-tis", "seq-tis", "geo-mask"] = Field(
        "tis",
        description="How the importance weights pi_prev / pi_generation (the trainer's logprobs of the "
        "parameters that sampled the rollout vs the engine's logprobs of the sampled tokens) are truncated; a "
        "sequence is a sample's valid tokens (token_mask: in a multi-turn sample the generated tokens of every "
        "turn). tis: clamp each weight to [ratio_min (null: 0), ratio]; icepop: zero the tokens whose weight is "
        "outside [ratio_min, ratio]; seq-mask-tis: zero the sequences whose geometric-mean weight is outside "
        "[ratio_min, ratio], the rest keep their untruncated token weights; seq-tis: one weight per sequence, "
        "exp(sum over its tokens of log pi_prev - log pi_generation), clamped to [ratio_min (null: 0), ratio] "
        "and applied to all its tokens (needs ratio; not with sequence_level_importance_ratios, whose tis is "
        "the same); geo-mask: no reweighting, a sequence whose geometric-mean weight exp(mean over its tokens "
        "of log pi_prev - log pi_generation) is outside [ratio_min, ratio] is left out of the loss, the others "
        "count with weight 1 (needs both bounds). seq-tis and geo-mask need use_importance_sampling_correction.",
    )
    use_cispo: bool = Field(
        False,
        description="CISPO: per-token loss -A * stopgrad(clip(r, 1 - ratio_clip_min, 1 + ratio_clip_max)) * log pi, "
        "so a clipped token still gets a gradient, only a bounded one.",
    )
    token_level_loss: bool = Field(
        True,
        description="True: mean over all valid tokens of the step; False: mean over each sequence's "
        "valid tokens, then over valid sequences.",
    )
    sequence_level_importance_ratios: bool = Field(
        False,
        description="GSPO: one ratio per sequence, exp(mean over its valid tokens of log pi - log pi_prev), "
        "applied to all its tokens.",
    )
    disable_ppo_ratio: bool = Field(
        False, description="REINFORCE: per-token loss -A * log pi, no ratio and no clipping."
    )
    force_on_policy_ratio: bool | None = Field(
        None,
        description="Use the current logprobs (detached) as prev_logprobs: the ratio is exactly 1 and its "
        "gradient the on-policy one, and the GRPO loop skips its prev-logprob pass. Exact when every rollout "
        "is trained in one optimizer step (all micro-batches see the parameters that sampled it). "
        "null: automatic, on exactly then (and the model has no dropout, and not with use_cispo); true: required "
        "(an error otherwise; refused with use_cispo, as NeMo-RL does); false: always run the pass. "
        "The loss itself reads null as false.",
    )

    @model_validator(mode="after")
    def _check_combinations(self) -> ClippedPGLossConfig:
        tis_type = self.truncated_importance_sampling_type
        low, high = self.truncated_importance_sampling_ratio_min, self.truncated_importance_sampling_ratio
        if (low is not None or high is not None) and not self.use_importance_sampling_correction:
            raise ValueError(
                "truncated_importance_sampling_ratio[_min] only act on importance weights: "
                "set use_importance_sampling_correction=true or leave them null"
            )
        if tis_type != "tis" and not self.use_importance_sampling_correction:
            raise ValueError(
                f"truncated_importance_sampling_type='{tis_type}' acts on the importance weights only: "
                "set use_importance_sampling_correction=true or leave the type at its default 'tis'"
            )
        if tis_type in ("icepop", "seq-mask-tis", "geo-mask") and self.use_importance_sampling_correction:
            if low is None or high is None:
                raise ValueError(
                    f"truncated_importance_sampling_type='{tis_type}' needs truncated_importance_sampling_ratio_min "
                    f"and truncated_importance_sampling_ratio, got [{low}, {high}]"
                )
        if low is not None and high is not None and not low <= high:
            raise ValueError(
                "truncated_importance_sampling_ratio_min must be <= truncated_importance_sampling_ratio, "
                f"got [{low}, {high}]"
            )
        if tis_type == "tis" and low is not None and high is None:
            raise ValueError(
                "truncated_importance_sampling_ratio_min needs truncated_importance_sampling_ratio: "
                "tis truncates to [ratio_min, ratio]"
            )
        if tis_type == "seq-tis" and high is None:
            raise ValueError(
                "truncated_importance_sampling_type='seq-tis' needs truncated_importance_sampling_ratio: "
                "it truncates each sequence's weight to [ratio_min (null: 0), ratio]"
            )
        if tis_type == "seq-tis" and self.sequence_level_importance_ratios:
            raise ValueError(
                "truncated_importance_sampling_type='seq-tis' with sequence_level_importance_ratios=true (GSPO) "
                "is 'tis', which already truncates GSPO's one weight per sequence: use 'tis'"
            )
        if tis_type == "seq-mask-tis" and self.sequence_level_importance_ratios:
            raise ValueError(
                "truncated_importance_sampling_type='seq-mask-tis' masks sequences but keeps token weights; "
                "sequence_level_importance_ratios=true (GSPO) already weighs whole sequences: use 'tis' or 'icepop'"
            )
        if self.use_cispo and self.force_on_policy_ratio is True:  # NeMo-RL's ClippedPGLossFn refuses it too
            raise ValueError(
                "use_cispo=true cannot be combined with force_on_policy_ratio=true: a forced ratio of 1 "
                "removes the clipped weight CISPO trains with; set force_on_policy_ratio to null or false"
            )
        if self.use_cispo:
            for on, name in (
                (self.disable_ppo_ratio, "disable_ppo_ratio=true"),
                (self.sequence_level_importance_ratios, "sequence_level_importance_ratios=true"),
                (self.ratio_clip_c is not None, "ratio_clip_c (dual clip)"),
                (not self.token_level_loss, "token_level_loss=false"),
            ):
                if on:
                    raise ValueError(
                        f"use_cispo=true cannot be combined with {name}: CISPO is a token-level "
                        "loss on the clipped per-token ratio"
                    )
        if self.disable_ppo_ratio and self.ratio_clip_c is not None:
            raise ValueError("ratio_clip_c clips the PPO ratio, which disable_ppo_ratio=true removes")
        if self.disable_ppo_ratio and self.sequence_level_importance_ratios:
            raise ValueError(
                "sequence_level_importance_ratios (GSPO) changes the PPO ratio, which disable_ppo_ratio=true removes"
            )
        return self
