"""GRPO's section (``grpo``): the rollout loop's settings plus GRPO's advantages, reward transforms, dynamic
sampling and asynchronous generation. Its loss is the top-level ``loss`` section (:mod:`.loss_config`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, PositiveInt

from rlcore.config.base import StrictModel
from rlcore.config.rollout_loop import RolloutLoopConfig


class AsyncGRPOConfig(StrictModel):
    """Generation runs ahead of training on its own resources (NeMo-RL's ``grpo.async_grpo`` spelling).

    The rollout a step trains on may come from weights up to
    ``max_trajectory_age_steps`` training steps older than the ones being
    trained; the loss corrects for it with importance weights against the
    engine's logprobs (``loss.use_importance_sampling_correction``).
    """

    enabled: bool = Field(
        False,
        description="Overlap generation of the next rollouts with training (needs "
        "non-colocated generation and loss.use_importance_sampling_correction).",
    )
    max_trajectory_age_steps: PositiveInt = Field(
        1,
        description="How many training steps older than the trained weights a rollout's weights may be; "
        "generation runs at most this many rollouts ahead. A rollout that would be older is regenerated. With "
        "in-flight weight updates the age is that of a sample's oldest tokens.",
    )
    in_flight_weight_updates: bool = Field(
        False,
        description="A refit lands while rollouts are being generated instead of after them (NeMo-RL's meaning): "
        "the engines pause as in_flight_pause_mode says, take the new weights and resume, so a sample's tokens "
        "may come from several weight versions (its age is that of the oldest). Needs grpo.async_grpo.enabled "
        "and a generation backend that declares 'in_flight_weight_updates' (rl-vllm with "
        "vllm_cfg.async_engine: true). False: each refit waits until the requests running finish.",
    )
    recompute_kv_cache_after_weight_updates: bool = Field(
        False,
        description="With in-flight weight updates and in_flight_pause_mode keep: after each refit the KV cache "
        "of the requests kept across it is computed again with the new weights before they continue (AREAL's "
        "way; their tokens and logprobs so far stay as generated). False: they continue on the cache the old "
        "weights computed (Magistral's way, NeMo-RL's default).",
    )
    in_flight_pause_mode: Literal["keep", "abort", "wait"] = Field(
        "keep",
        description="With in-flight weight updates: what a refit does to the requests running. keep: they stop "
        "between two engine steps and continue on the new weights (NeMo-RL's in-flight behaviour); abort: they "
        "are dropped and started again from their prompt on the new weights (each sample then comes from one "
        "version); wait: they finish on the old weights first (a drain: what happens without in-flight updates).",
    )


class RewardScalingConfig(StrictModel):
    """A linear map of every reward from one range onto another, before anything else reads the rewards.

    NeMo-RL's ``grpo.reward_scaling``: a reward is first clamped into
    ``[source_min, source_max]``, then mapped linearly so that ``source_min``
    becomes ``target_min`` and ``source_max`` becomes ``target_max`` (DAPO maps
    a 0/1 accuracy onto -1/1).
    """

    enabled: bool = Field(
        False,
        description="Scale every reward: clamp it into [source_min, source_max], then map "
        "that range linearly onto [target_min, target_max]. Applied first, before "
        "grpo.reward_shaping.",
    )
    source_min: float = Field(
        0.0,
        description="Lower end of the range rewards are expected in; a smaller reward "
        "is raised to it before the map (it becomes target_min).",
    )
    source_max: float = Field(
        1.0,
        description="Upper end of the range rewards are expected in (> source_min); a "
        "larger reward is lowered to it before the map (it becomes target_max).",
    )
    target_min: float = Field(0.0, description="What a reward equal to source_min becomes.")
    target_max: float = Field(1.0, description="What a reward equal to source_max becomes.")


class RewardShapingConfig(StrictModel):
    """Length-dependent reward penalties (NeMo-RL's ``grpo.reward_shaping``), after grpo.reward_scaling.

    Two mutually exclusive forms. With ``stop_properly_penalty_coef`` set
    (ProRL's), the reward of every truncated completion is multiplied by it,
    and the three overlong keys are not used. Otherwise DAPO's overlong
    penalty: a completion longer than ``max_response_length -
    overlong_buffer_length`` tokens loses ``overlong_buffer_penalty`` times
    the fraction of the buffer it ran into.
    """

    enabled: bool = Field(
        False,
        description="Shape the (scaled) rewards: the truncation penalty when "
        "stop_properly_penalty_coef is set, else DAPO's overlong penalty (which needs "
        "overlong_buffer_length, overlong_buffer_penalty and max_response_length).",
    )
    overlong_buffer_length: PositiveInt | None = Field(
        None,
        description="DAPO: length of the penalty buffer, in tokens, at the end of max_response_length. A "
        "completion of L tokens gets min(0, -(L - (max_response_length - overlong_buffer_length)) / "
        "overlong_buffer_length * overlong_buffer_penalty) added to its reward. Ignored when "
        "stop_properly_penalty_coef is set.",
    )
    overlong_buffer_penalty: float | None = Field(
        None,
        ge=0.0,
        description="DAPO: the penalty at the end of the buffer (a completion of exactly "
        "max_response_length tokens loses this much); it keeps growing linearly past max_response_length, as in "
        "NeMo-RL. Ignored when stop_properly_penalty_coef is set.",
    )
    max_response_length: PositiveInt | None = Field(
        None,
        description="DAPO: the completion length, in tokens, at which the penalty reaches "
        "overlong_buffer_penalty (NeMo-RL's examples: ${policy.max_total_sequence_length}). The length is that "
        "of the completion's first assistant turn. Ignored when stop_properly_penalty_coef is set.",
    )
    stop_properly_penalty_coef: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="When set: the reward of each truncated completion (cut by a token "
        "budget before it stopped) is multiplied by this (0 = zero reward, 1 = no penalty), and the DAPO "
        "overlong penalty is not applied. None: the DAPO overlong penalty.",
    )


class GDPOConfig(StrictModel):
    """GDPO's settings (NeMo-RL's ``grpo.adv_estimator`` keys for ``name: gdpo``); read only with
    ``grpo.advantage_estimator: gdpo``.

    GDPO (group reward-decoupled normalization, https://arxiv.org/abs/2601.05242)
    trains on an environment that returns several named rewards per sample
    (``EnvironmentReturn.reward_components``). Each component is judged
    within its prompt's group on its own, so that two completions with the
    same total but different components (1+0 and 0+1) no longer get the same
    advantage; the weighted sum of the components' advantages is then
    standardized over the whole batch.
    """

    use_leave_one_out_baseline: bool = Field(
        False,
        description="Each component's baseline (and, with normalize_rewards, its std) is that of the "
        "group's other completions, not of the whole group. NeMo-RL's GDPO example and the paper: false.",
    )
    normalize_rewards: bool = Field(
        True,
        description="Divide each component's group advantage by its group std + 1e-6 (where that std is > "
        "0) before they are combined. The final whole-batch standardization runs either way.",
    )
    reward_weights: list[float] | None = Field(
        None,
        description="One weight per reward component, in the order of the components' names sorted "
        "alphabetically (the environment's names: see the reward/<name>_mean metrics); the advantage is the "
        "weighted sum of the components' advantages. None = 1 each. A count other than the environment's "
        "components is an error at the first step.",
    )


#: The advantage estimators whose advantages are per token and need the rollout's logprobs first (Reinforce++).
TOKEN_LEVEL_ESTIMATORS = ("reinforce_plus_plus", "reinforce_plus_plus_baseline")


class GRPOConfig(RolloutLoopConfig):
    """Group Relative Policy Optimization: several completions per prompt, advantages within the group."""

    advantage_estimator: Literal[
        "leave_one_out",
        "leave_one_out_std",
        "mean",
        "mean_std",
        "gdpo",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
    ] = Field(
        "leave_one_out",
        description="leave_one_out: reward minus the mean of the group's other rewards; leave_one_out_std: that, "
        "divided by the others' std + eps where it is > 0 (NeMo-RL's GRPO default); mean: reward minus the "
        "group mean; mean_std: (reward - group mean) / (group std + eps); gdpo: for an environment that returns "
        "several named rewards, each one's group advantage (settings: grpo.gdpo), weighted, summed and "
        "standardized over the batch; reinforce_plus_plus: the reward at "
        "every token (minus beta * KL there with loss.use_kl_in_reward), whitened over all tokens of the "
        "batch; reinforce_plus_plus_baseline: the same from reward minus the group mean (NeMo-RL's "
        "minus_baseline).",
    )
    gdpo: GDPOConfig = Field(
        default_factory=GDPOConfig, description="GDPO's settings (with advantage_estimator: gdpo)."
    )
    async_grpo: AsyncGRPOConfig = Field(
        default_factory=AsyncGRPOConfig, description="Asynchronous GRPO: generation runs ahead of training."
    )
    reward_scaling: RewardScalingConfig = Field(
        default_factory=RewardScalingConfig,
        description="Linear rescaling of the rewards (first of the reward transforms).",
    )
    reward_shaping: RewardShapingConfig = Field(
        default_factory=RewardShapingConfig,
        description="Length penalties on the rewards (after reward_scaling): "
        "DAPO's overlong penalty or the truncation penalty.",
    )
    use_dynamic_sampling: bool = Field(
        False,
        description="DAPO's dynamic sampling: a step generates batches of num_prompts_per_step * "
        "batch_multiplier prompts until it holds num_prompts_per_step groups whose rewards (after reward_scaling, "
        "before reward_shaping) are not all equal, and trains on those; the rest are dropped.",
    )
    dynamic_sampling_max_gen_batches: PositiveInt = Field(
        10,
        description="Dynamic sampling: the most generation batches one step may draw; a step that has not "
        "found enough groups by then stops the run with an error. Only with use_dynamic_sampling.",
    )
    batch_multiplier: float = Field(
        1.0,
        ge=1.0,
        description="Dynamic sampling: each generation batch has int(num_prompts_per_step * "
        "batch_multiplier) prompts (more per batch, fewer batches per step). Must be 1 without "
        "use_dynamic_sampling.",
    )
    advantage_clip_low: float | None = Field(
        None,
        description="Lower bound the advantages are clamped to after they are computed (and normalized); "
        "None = no bound. <= 0.",
    )
    advantage_clip_high: float | None = Field(
        None,
        description="Upper bound the advantages are clamped to after they are computed (and normalized); "
        "None = no bound. >= 0.",
    )
    invalid_tool_call_advantage: float | None = Field(
        None,
        description="The advantage every generated token of an assistant turn the environment flagged as an "
        "invalid tool call gets (EnvironmentReturn.invalid_tool_calls: the tools environment flags a malformed "
        "call, an unknown tool, arguments that do not fit, calls past its per-turn limit), overwriting the "
        "computed one before grpo.advantage_clip_low/high (NeMo-RL's order), e.g. -5. None: advantages are left "
        "as computed. Accepted with any environment: one that never flags a turn leaves every advantage as "
        "computed (invalid_tool_call_rate stays 0).",
    )
    overlong_filtering: bool = Field(
        False,
        description="Leave truncated completions (cut by a token budget before they stopped) out of the "
        "loss: their sample weight is 0. They still count in their group's baseline and std; Reinforce++ also "
        "leaves them out of its batch whitening.",
    )

    @property
    def prompts_per_generation_batch(self) -> int:
        """Prompts per batch drawn from the data: ``num_prompts_per_step``, times ``batch_multiplier`` (rounded
        down, as NeMo-RL does) with dynamic sampling."""
        if not self.use_dynamic_sampling:
            return self.num_prompts_per_step
        return int(self.num_prompts_per_step * self.batch_multiplier)

    def draw_settings(self, name: str, cfg: Any) -> dict[str, Any]:
        settings = super().draw_settings(name, cfg)
        if self.use_dynamic_sampling:
            settings["size_setting"] = f"{name}.num_prompts_per_step * {name}.batch_multiplier"
        return settings
