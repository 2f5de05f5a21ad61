"""PPO's sections: ``ppo`` (:class:`PPOConfig`, NeMo-RL's keys and defaults, ``nemo_rl/algorithms/ppo.py``) and the
critic's loss section (:class:`ValueLossConfig`, NeMo-RL's top-level ``value_loss_fn``). The policy's loss is GRPO's
``loss`` section. A NeMo-RL key whose behaviour rlcore does not have is refused here, naming its dotted path and the
fix, before any process starts. Light: importing it imports neither torch nor the loop."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, NonNegativeInt, PositiveInt, field_validator, model_validator

from rlcore.algorithms.grpo.config import AsyncGRPOConfig, RewardScalingConfig, RewardShapingConfig
from rlcore.config.base import StrictModel
from rlcore.config.overrides import merged_section
from rlcore.config.rollout_loop import RolloutLoopConfig


class AsyncPPOConfig(AsyncGRPOConfig):
    """Asynchronous PPO (NeMo-RL's ``ppo.async_ppo``): generation fills a buffer on its own resources while the
    policy and the critic train; values and logprobs are computed again when a rollout is trained on. The
    in-flight settings mean what they mean for GRPO (``grpo.async_grpo``)."""

    enabled: bool = Field(
        False,
        description="Overlap generation of the next rollouts with training (NeMo-RL: needs non-colocated "
        "generation and loss.use_importance_sampling_correction).",
    )
    in_flight_weight_updates: bool = Field(
        False,
        description="A refit lands while rollouts are being generated instead of after them: the engines pause as "
        "in_flight_pause_mode says, take the new weights and resume, so a sample's tokens may come from several "
        "weight versions (its age is that of the oldest). Needs ppo.async_ppo.enabled and a generation backend "
        "that declares 'in_flight_weight_updates'.",
    )
    warmup_generation_lead_steps: PositiveInt | None = Field(
        None,
        description="During critic warmup (ppo.policy_training_start_step > 0, the policy frozen) generation may "
        "run this many steps ahead instead of max_trajectory_age_steps, banking rollouts for later; frozen-policy "
        "rollouts are trained on up to policy_training_start_step + max_trajectory_age_steps. Must be >= "
        "max_trajectory_age_steps; null: max_trajectory_age_steps throughout. Needs policy_training_start_step > 0.",
    )
    drop_incomplete_targets_on_restore: bool = Field(
        False,
        description="On --resume, a step whose buffered rollouts were only partly restored drops them and fills "
        "the step from the next prompts of the data (the original prompts are not generated again). false: the "
        "restored rows are kept and the step is topped up.",
    )

    @model_validator(mode="after")
    def _lead_covers_the_age(self) -> AsyncPPOConfig:
        lead = self.warmup_generation_lead_steps
        if lead is not None and lead < self.max_trajectory_age_steps:
            raise ValueError(
                f"ppo.async_ppo.warmup_generation_lead_steps ({lead}) must be >= max_trajectory_age_steps "
                f"({self.max_trajectory_age_steps}); raise it or set it to null"
            )
        return self

    @property
    def generation_lead_during_warmup(self) -> int:
        """How many steps ahead generation may run while the policy is frozen (NeMo-RL's
        ``resolved_warmup_generation_lead_steps``)."""
        lead = self.warmup_generation_lead_steps
        return self.max_trajectory_age_steps if lead is None else lead


class GAEConfig(StrictModel):
    """The advantage estimator (NeMo-RL's ``ppo.adv_estimator``): generalized advantage estimation on the critic's
    values, with VAPO's (https://arxiv.org/abs/2504.05118) decoupled and length-adaptive lambda
    (:mod:`rlcore.algorithms.ppo.gae`)."""

    name: Literal["gae"] = Field(
        "gae",
        description="gae: generalized advantage estimation with the critic's values (the only estimator; "
        "NeMo-RL's critic-free raw_reward is refused: train GRPO for advantages without a critic).",
    )
    gae_lambda: float = Field(
        0.95,
        ge=0.0,
        le=1.0,
        description="lambda: 0 is one-step TD (low variance, biased by the critic), 1 the Monte Carlo return "
        "minus the value. Used for both the returns and the advantages unless gae_lambda_value / "
        "gae_lambda_policy / length_adaptive_alpha say otherwise.",
    )
    gae_gamma: float = Field(
        1.0, ge=0.0, le=1.0, description="Discount gamma per generated token (1: outcome rewards, no discount)."
    )
    normalize_advantages: bool = Field(
        True,
        description="Whiten the advantages over every generated token of the step's batch (token_mask * "
        "sample_mask): (A - mean) / sqrt(var + 1e-8), unbiased variance; the returns are not touched.",
    )
    gae_lambda_value: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="VAPO: the lambda of the critic's returns (VAPO: 1.0, Monte Carlo-like). null: gae_lambda.",
    )
    gae_lambda_policy: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="VAPO: the lambda of the policy's advantages. null: gae_lambda (or length-adaptive with "
        "length_adaptive_alpha > 0, which cannot be combined with it).",
    )
    length_adaptive_alpha: float = Field(
        0.0,
        ge=0.0,
        description="VAPO: > 0 makes the policy's lambda per sequence, 1 - 1 / max(alpha * l, 1) with l the "
        "sequence's generated tokens (all turns), so long answers get a lambda near 1 (VAPO: 0.05). 0: off.",
    )

    @field_validator("name", mode="before")
    @classmethod
    def _gae_only(cls, value: Any) -> Any:
        if value == "raw_reward":
            raise ValueError(
                "ppo.adv_estimator.name: 'raw_reward' (the reward as the advantage, no critic) is not supported; "
                "use name: gae, or train GRPO (grpo.advantage_estimator) for advantages without a critic"
            )
        return value

    @model_validator(mode="after")
    def _one_policy_lambda(self) -> GAEConfig:
        if self.length_adaptive_alpha > 0 and self.gae_lambda_policy is not None:
            raise ValueError(
                f"ppo.adv_estimator.gae_lambda_policy ({self.gae_lambda_policy}) is not used when "
                f"length_adaptive_alpha ({self.length_adaptive_alpha}) > 0 (the policy's lambda is then per "
                "sequence); set gae_lambda_policy to null or length_adaptive_alpha to 0"
            )
        return self

    @property
    def decoupled(self) -> bool:
        """Whether the returns and the advantages may use different lambdas (NeMo-RL then computes GAE twice)."""
        return self.gae_lambda_value is not None or self.gae_lambda_policy is not None or self.length_adaptive_alpha > 0

    @property
    def lambda_value(self) -> float:
        """The lambda of the critic's returns."""
        return self.gae_lambda if self.gae_lambda_value is None else self.gae_lambda_value


class PPOConfig(RolloutLoopConfig):
    """Proximal Policy Optimization with a critic: completions scored by the environment, per-token advantages by
    GAE on a value model's estimates, ppo_epochs updates of the critic then the policy per rollout."""

    num_prompts_per_step: PositiveInt = Field(32, description="Prompts sampled per step.")
    num_generations_per_prompt: PositiveInt = Field(
        16, description="Completions per prompt (PPO's advantages do not compare them; recipes use 1)."
    )
    max_num_steps: PositiveInt = Field(100000, description="Training steps (each: generate, score, values, train).")
    max_num_epochs: PositiveInt | None = Field(
        100000,
        description="Passes over the training data; the run ends at whichever of this and max_num_steps comes "
        "first. null, or NeMo-RL's -1 (which its async recipes write): only max_num_steps bounds it.",
    )
    seed: int = Field(42, description="Seed of prompt sampling and generation.")
    val_period: NonNegativeInt = Field(20, description="Validate every N steps (after the step trains); 0: never.")
    val_at_start: bool = Field(True, description="Validate the initial weights before the first step.")
    max_val_samples: PositiveInt | None = Field(
        256, description="Validate on the first N samples of data.validation; null: all of them."
    )
    val_batch_size: PositiveInt = Field(256, description="Prompts generated per validation batch.")
    ppo_epochs: PositiveInt = Field(
        4,
        description="Updates per rollout: each trains the critic on the returns, then the policy on the "
        "advantages, both computed once from the rollout (critic before actor, as veRL and NeMo-RL).",
    )
    policy_training_start_step: NonNegativeInt = Field(
        0,
        description="Critic warmup: the first N steps train only the critic (generation and scoring run as "
        "usual, the policy's weights stay); from step N both train. 0: both from the start.",
    )
    overlong_filtering: bool = Field(
        False,
        description="Leave truncated completions (cut by a token budget before they stopped) out of the "
        "advantages and both losses: their sample weight is 0.",
    )
    use_dynamic_sampling: bool = Field(
        False,
        description="DAPO's dynamic sampling; not supported for PPO (false only): rlcore's is GRPO's "
        "(grpo.use_dynamic_sampling), which reads the grpo section.",
    )
    dynamic_sampling_max_gen_batches: PositiveInt = Field(
        10, description="Read only with use_dynamic_sampling, which PPO does not support (kept for NeMo-RL configs)."
    )
    batch_multiplier: float = Field(
        1.0, description="Read only with use_dynamic_sampling; must be 1 (NeMo-RL refuses other values without it)."
    )
    skip_reference_policy_logprobs_calculation: bool = Field(
        True,
        description="Do not compute the reference policy's logprobs (needs loss.reference_policy_kl_penalty 0: "
        "there is then no KL term to compute). false: compute them every step.",
    )
    async_ppo: AsyncPPOConfig = Field(
        default_factory=AsyncPPOConfig, description="Asynchronous PPO: generation runs ahead of training."
    )
    reward_scaling: RewardScalingConfig = Field(
        default_factory=RewardScalingConfig,
        description="Linear rescaling of the rewards, as grpo.reward_scaling (first of the reward transforms).",
    )
    reward_shaping: RewardShapingConfig = Field(
        default_factory=RewardShapingConfig,
        description="Length penalties on the (scaled) rewards, as grpo.reward_shaping: DAPO's overlong penalty or "
        "the truncation penalty (stop_properly_penalty_coef).",
    )
    adv_estimator: GAEConfig = Field(
        default_factory=GAEConfig, description="The advantage estimator: GAE on the critic's values."
    )
    seq_logprob_error_threshold: float | None = Field(
        None,
        description="NeMo-RL's sequence-level masking by the engine/trainer probability error; not supported "
        "(null only), as for GRPO. The per-token gap is in the loss metrics (token_mult_prob_error).",
    )

    value: dict[str, Any] = Field(
        default_factory=dict,
        description="The critic's own policy settings, each a policy key over the policy's (e.g. {optimizer: "
        "{kwargs: {lr: 1.0e-5}}, dtensor_cfg: {tensor_parallel_size: 2}, model_name: ...}): the critic is a Policy "
        "of the merge with a value head (model_head='value') and its own optimizer, trained on the returns. "
        "NeMo-RL's top-level value section. Not generation (the critic does not generate) nor tokenizer (it reads "
        "the policy's token ids).",
    )

    @field_validator("value")
    @classmethod
    def _critic_settings_only(cls, value: dict[str, Any]) -> dict[str, Any]:
        for key, why in CRITIC_NOT_OWN.items():
            if key in value:
                raise ValueError(f"ppo.value.{key} is not the critic's own setting: {why}; remove it")
        return value

    def value_policy(self, policy: Any) -> dict[str, Any]:
        """The critic's policy settings as a dict: ``policy`` (the ``PolicyConfig``) with :attr:`value` merged over
        it (nested sections key by key), the policy's tokenizer and no generation."""
        merged = merged_section(policy.model_dump(exclude_unset=True), self.value)
        return {**merged, "tokenizer": policy.tokenizer.model_dump(exclude_unset=True), "generation": None}

    @field_validator("max_num_epochs", mode="before")
    @classmethod
    def _minus_one_is_unbounded(cls, value: Any) -> Any:
        return None if value == -1 and not isinstance(value, bool) else value

    @model_validator(mode="after")
    def _refuse_what_rlcore_does_not_do(self) -> PPOConfig:
        if self.use_dynamic_sampling:
            raise ValueError(
                "ppo.use_dynamic_sampling: true is not supported (rlcore's dynamic sampling is GRPO's and reads the "
                "grpo section); set it to false, or train GRPO with grpo.use_dynamic_sampling"
            )
        if self.batch_multiplier != 1:
            raise ValueError(
                f"ppo.batch_multiplier ({self.batch_multiplier}) is read only with dynamic sampling, which PPO does "
                "not support; set it to 1"
            )
        if self.seq_logprob_error_threshold is not None:
            raise ValueError(
                f"ppo.seq_logprob_error_threshold ({self.seq_logprob_error_threshold}): masking sequences by their "
                "engine/trainer probability error is not supported; set it to null"
            )
        scaling = self.reward_scaling
        if scaling.enabled and scaling.source_max <= scaling.source_min:
            raise ValueError(
                f"ppo.reward_scaling.source_max ({scaling.source_max}) must be > source_min ({scaling.source_min}); "
                "fix the range or set ppo.reward_scaling.enabled to false"
            )
        shaping = self.reward_shaping
        dapo_keys = (shaping.overlong_buffer_length, shaping.overlong_buffer_penalty, shaping.max_response_length)
        if shaping.enabled and shaping.stop_properly_penalty_coef is None and None in dapo_keys:
            raise ValueError(
                "ppo.reward_shaping.enabled: DAPO's overlong penalty needs overlong_buffer_length, "
                "overlong_buffer_penalty and max_response_length; set them, or stop_properly_penalty_coef, or "
                "enabled: false"
            )
        if self.async_ppo.warmup_generation_lead_steps is not None and self.policy_training_start_step == 0:
            raise ValueError(
                "ppo.async_ppo.warmup_generation_lead_steps is read only during critic warmup; set "
                "ppo.policy_training_start_step > 0 or warmup_generation_lead_steps to null"
            )
        return self

    def policy_trains(self, step: int) -> bool:
        """Whether the policy trains at ``step`` (0-based count of steps done before it): after the critic's
        warmup of ``policy_training_start_step`` steps."""
        return step >= self.policy_training_start_step


#: Policy keys the critic takes from the policy or has no use for, and why.
CRITIC_NOT_OWN = {
    "generation": "the critic does not generate",
    "tokenizer": "the critic reads the policy's token ids, so it has the policy's tokenizer",
}


class ValueLossConfig(StrictModel):
    """The critic's loss section (NeMo-RL's top-level ``value_loss_fn``, its ``MseValueLossConfig``):
    :class:`rlcore.algorithms.ppo.value_loss.ValueLossFn`."""

    scale: float = Field(
        1.0,
        gt=0.0,
        description="Factor on the value loss, 0.5 * scale * the mean over valid tokens of the squared error "
        "(NeMo-RL's recipes: 0.4 or 1.0).",
    )
    cliprange: float | None = Field(
        None,
        gt=0.0,
        description="PPO2's value clipping: the loss of a token is the larger of the squared errors of the value "
        "and of the value clipped to [old value - cliprange, old value + cliprange] (old: the critic's values "
        "when the rollout was scored). null: no clipping.",
    )
