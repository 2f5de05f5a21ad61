"""The NeMo-RL → rlcore rules of the algorithm sections, ``loss_fn``, ``checkpointing``, ``logger``, ``data``,
``env`` and the rest (:mod:`rlcore.nemo_rl.table`)."""

from __future__ import annotations

from rlcore.nemo_rl.rule import (  # the tables' shorthand: map, custom, ignore, neutral, gate
    LOGGING,
    MEMORY,
    NONE_OR_EMPTY,
    G,
    P,
    Rule,
    _c,
    _i,
    _m,
    _n,
)

ALGORITHM_AND_RUN_RULES: tuple[Rule, ...] = (
    # -- grpo -----------------------------------------------------------------------------------
    _m("grpo.num_prompts_per_step"),
    _m("grpo.num_generations_per_prompt"),
    _m("grpo.max_num_steps"),
    _m("grpo.seed"),
    _c(
        "grpo.use_leave_one_out_baseline",
        "advantage",
        "grpo.advantage_estimator",
        "with normalize_rewards: both → leave_one_out_std, leave-one-out only → leave_one_out, normalize only "
        "→ mean_std, neither → mean",
    ),
    _c("grpo.normalize_rewards", "advantage", "grpo.advantage_estimator", "see use_leave_one_out_baseline"),
    _c(
        "grpo.adv_estimator",
        "advantage",
        "grpo.advantage_estimator",
        "name 'grpo' with its own normalize_rewards / use_leave_one_out_baseline (these win); 'gdpo' → gdpo, "
        "with those two (default true) and reward_weights → grpo.gdpo; 'reinforce_plus_plus' with minus_baseline "
        "→ reinforce_plus_plus[_baseline]; other estimators are errors",
    ),
    _m("grpo.max_rollout_turns"),
    _m("grpo.max_num_epochs"),
    *(
        _m(
            f"{algo}.val_period",
            transform="negative_is_off",
            note="NeMo-RL validates when val_period > 0: a negative period is 0 (off)",
        )
        for algo in ("grpo", "sft", "dpo", "distillation", "ppo")
    ),
    *(_m("grpo." + k) for k in ("val_at_start", "val_at_end", "max_val_samples", "val_batch_size")),
    _n("grpo.val_start_at", (-1, None), "starting validation at a later step"),
    _n("grpo.val_num_generations_per_prompt", (1, None), "several validation completions per prompt (pass@k)"),
    _n("grpo.stop_at_validation_metric", (None,), "stopping at a validation threshold"),
    _n("grpo.stop_at_validation_threshold", (None,), "stopping at a validation threshold"),
    *(_i(G + k, "rlcore validates greedily (docs/tasks.md)") for k in ("val_temperature", "val_top_p", "val_top_k")),
    _i(G + "refit_cfg", "refit transport: rlcore refits through its own synchronizer (docs/refit.md)"),
    _i(G + "real_quant_export_cpu_offload", MEMORY),
    _m(
        G + "vllm_cfg.logprobs_mode",
        note="processed_logprobs or raw_logprobs (raw only where sampling is the model's own distribution); the "
        "*_logits modes are refused",
    ),
    _i(
        P + "sequence_packing.microbatch_order",
        "the order packed micro-batches run in: the gradients add up to the same sum",
    ),
    *(_m("grpo." + k) for k in ("overlong_filtering", "advantage_clip_low", "advantage_clip_high")),
    _m("grpo.use_dynamic_sampling", note="whole groups kept or dropped; see docs/tasks.md"),
    _m("grpo.dynamic_sampling_max_gen_batches", note="at most this many batches per step (NeMo-RL: one more)"),
    _m("grpo.batch_multiplier"),
    *(
        _m("grpo.reward_shaping." + k)
        for k in ("enabled", "overlong_buffer_length", "overlong_buffer_penalty", "stop_properly_penalty_coef")
    ),
    _m(
        "grpo.reward_shaping.max_response_length",
        note="NeMo-RL's examples write ${policy.max_total_sequence_length}: resolved before conversion",
    ),
    *(_m("grpo.reward_scaling." + k) for k in ("enabled", "source_min", "source_max", "target_min", "target_max")),
    _m("grpo.async_grpo.enabled"),
    _m("grpo.async_grpo.max_trajectory_age_steps"),
    _m(
        "grpo.async_grpo.in_flight_weight_updates",
        note="a refit lands while requests run; they continue on the new weights (rlcore's in_flight_pause_mode "
        "keep); needs an engine that serves continuously (policy.generation.vllm_cfg.async_engine)",
    ),
    _c(
        "grpo.async_grpo.recompute_kv_cache_after_weight_updates",
        "kv_recompute",
        "grpo.async_grpo.recompute_kv_cache_after_weight_updates",
        "the kept requests' KV caches are computed again with the new weights (AREAL's way); without in-flight "
        "updates ignored (nothing computed on older weights outlives a refit)",
    ),
    _n("grpo.seq_logprob_error_threshold", (None,), "sequence logprob-error filtering"),
    _m(
        "grpo.invalid_tool_call_advantage",
        note="the tokens of an assistant turn the environment flags as an invalid tool call get this advantage "
        "(the tools environment and the endpoint's agents flag them; docs/tools.md)",
    ),
    _n("grpo.malformed_thinking_advantage", (None,), "thinking-tag advantages"),
    _i(
        "grpo.deduplicate_multimodal_data",
        "sharing a prompt's image payload among its generations: transport and memory only, and rlcore's image "
        "batches share each prompt's pixels among its copies already (docs/vision.md)",
    ),
    _i("grpo.debug_payload_metrics", "payload-size metrics of NeMo-RL's Ray transfers: " + LOGGING),
    _n("grpo.skip_reference_policy_logprobs_calculation", (False, None), "skipping reference logprobs"),
    # -- sft (a config with an sft section and no grpo section is an SFT run: rlcore/nemo_rl/sft.py) --------
    *(
        _m("sft." + k)
        for k in (
            "max_num_steps",
            "max_num_epochs",
            "val_batches",
            "val_global_batch_size",
            "val_micro_batch_size",
            "val_at_start",
            "val_at_end",
            "only_unmask_final",
        )
    ),
    _m(
        "sft.seed",
        note="the sample order and the data.split_validation_size draw; absent sft keys take NeMo-RL's "
        "defaults (val_period 10, val_batches 8, val_at_start true, seed 42)",
    ),
    # -- dpo (a config with a dpo section and no grpo section is a DPO run: rlcore/nemo_rl/dpo.py) --------
    *(
        _m("dpo." + k)
        for k in (
            "max_num_steps",
            "max_num_epochs",
            "val_batches",
            "val_global_batch_size",
            "val_micro_batch_size",
            "val_at_start",
            "val_at_end",
        )
    ),
    _m(
        "dpo.seed",
        note="the pair order; absent dpo keys take NeMo-RL's defaults (val_period 25, val_batches 8, "
        "val_at_start true, seed 42), and dpo.add_bos / add_eos / add_generation_prompt are set true / true / false, "
        "how NeMo-RL's DPO tokenizes pairs",
    ),
    *(
        _m("dpo." + k, note="the loss's option (DPOLossFn), NeMo-RL's meaning")
        for k in (
            "reference_policy_kl_penalty",
            "preference_loss_weight",
            "sft_loss_weight",
            "preference_average_log_probs",
            "sft_average_log_probs",
        )
    ),
    _n(
        "dpo.preference_loss",
        ("dpo", None),
        "preference losses other than DPO (a TODO in NeMo-RL, which does not read the key)",
    ),
    _n("dpo.gt_reward_scale", (1, None), "RPO's reward scale (a TODO in NeMo-RL, which does not read the key)"),
    # -- distillation (a distillation section and no grpo section: rlcore/nemo_rl/distillation.py) ----------
    *(
        _m("distillation." + k)
        for k in (
            "num_prompts_per_step",
            "num_generations_per_prompt",
            "max_rollout_turns",
            "max_num_steps",
            "max_num_epochs",
            "val_at_start",
            "val_at_end",
            "max_val_samples",
            "val_batch_size",
            "topk_logits_k",
        )
    ),
    _m(
        "distillation.seed",
        note="absent distillation keys take NeMo-RL's defaults (num_prompts_per_step 128, "
        "max_num_steps 1000, max_num_epochs 10, val_batch_size 64, val_period 20, max_val_samples 512, seed 42)",
    ),
    _m(
        "loss_fn.kl_type",
        "distillation.kl_type",
        note="distillation configs (NeMo-RL's distillation loss, which "
        "reads only these three loss_fn keys: the others are ignored there)",
    ),
    _m("loss_fn.mixed_kl_weight", "distillation.mixed_kl_weight", note="distillation configs"),
    _m(
        "loss_fn.zero_outside_topk",
        "distillation.zero_outside_topk",
        note="distillation configs; true needs a "
        "student backend with the loss inputs logprobs_at_indices and entropy (dtensor, fsdp1, megatron, reference)",
    ),
    _c("teacher.model_name", "teacher", "distillation.teacher_model_name", "distillation configs: the teacher model"),
    _c(
        "teacher",
        "teacher",
        "distillation.teacher",
        "distillation configs: each other key is converted as "
        "policy's; one that differs from the student's is the teacher's own (distillation.teacher.<policy key>: its "
        "parallel layout, precision, batch sizes), the rest are the student's; generation, optimizer, scheduler "
        "ignored (NeMo-RL's teacher does not generate or train), tokenizer.name ignored (NeMo-RL's teacher reads "
        "the student's token ids; a teacher model of another vocabulary is refused when the run starts, as NeMo-RL "
        "refuses it, and rlcore's distillation.teacher.tokenizer.name maps it instead); other configs: ignored",
    ),
    # -- ppo (a ppo section: rlcore/nemo_rl/ppo.py; rlcore's PPOConfig takes NeMo-RL's keys and defaults) ---------
    *(
        _m("ppo." + k)
        for k in (
            "num_prompts_per_step",
            "num_generations_per_prompt",
            "max_rollout_turns",
            "max_num_epochs",
            "max_num_steps",
            "ppo_epochs",
            "policy_training_start_step",
            "val_at_start",
            "val_at_end",
            "overlong_filtering",
            "max_val_samples",
            "val_batch_size",
            "seed",
            "use_dynamic_sampling",
            "dynamic_sampling_max_gen_batches",
            "batch_multiplier",
            "skip_reference_policy_logprobs_calculation",
            "async_ppo",
            "reward_shaping",
            "adv_estimator",
            "reward_scaling",
            "seq_logprob_error_threshold",
        )
    ),
    *(_m("value_loss_fn." + k, "value_loss." + k) for k in ("scale", "cliprange")),
    _c(
        "value",
        "value",
        "ppo.value",
        "PPO configs: the critic's policy section; each key is converted as policy's and one that differs from the "
        "policy's is the critic's own (ppo.value.<policy key>: its backend, parallel layout, learning rate, batch "
        "sizes), the rest are the policy's; reward_model_cfg {enabled: true, reward_model_type: regression} is the "
        "value head rlcore builds; other configs: ignored",
    ),
    # -- rm (an rm section and no grpo section: rlcore/nemo_rl/rm.py; rlcore's RMConfig takes NeMo-RL's defaults) --
    *(
        _m("rm." + k)
        for k in ("max_num_epochs", "val_global_batch_size", "val_micro_batch_size", "val_at_start", "val_at_end")
    ),
    _m("rm.max_num_steps", note="-1 (NeMo-RL's default) trains max_num_epochs epochs"),
    _m(
        "rm.val_period",
        transform="negative_is_off",
        note="NeMo-RL validates when val_period > 0: a negative period is 0 (off)",
    ),
    _m("rm.val_batches", transform="negative_is_off", note="-1 (NeMo-RL's default: every validation batch) is 0"),
    _m(
        "rm.seed",
        note="the pair order; policy.reward_model_cfg enabled with reward_model_type bradley_terry is what rm does "
        "(the policy as a value model, the Bradley-Terry loss; other types are errors); the data is read as DPO's, "
        "rm.add_bos / add_eos / add_generation_prompt set true / true / false, NeMo-RL's tokenization of pairs",
    ),
    # -- loss_fn --------------------------------------------------------------------------------
    *(
        _m("loss_fn." + k, "loss." + k)
        for k in (
            "reference_policy_kl_penalty",
            "reference_policy_kl_type",
            "kl_input_clamp_value",
            "kl_output_clamp_value",
            "ratio_clip_min",
            "ratio_clip_max",
            "ratio_clip_c",
            "use_on_policy_kl_approximation",
            "token_level_loss",
            "sequence_level_importance_ratios",
            "disable_ppo_ratio",
            "use_cispo",
            "use_kl_in_reward",
            "positive_example_nll_weight",
        )
    ),
    _m(
        "loss_fn.force_on_policy_ratio",
        "loss.force_on_policy_ratio",
        transform="false_is_automatic",
        note="false = null (automatic): NeMo-RL's false runs the prev-logprob pass, which only repeats the "
        "current logprobs when the rollout is trained in one optimizer step; rlcore skips it exactly then",
    ),
    _c(
        "loss_fn.use_importance_sampling_correction",
        "importance_sampling",
        "loss.use_importance_sampling_correction",
        "as is; while false the truncated_importance_sampling_* keys do nothing and are ignored",
    ),
    *(
        _c("loss_fn." + k, "importance_sampling", "loss." + k, "as is (null type = 'tis')")
        for k in (
            "truncated_importance_sampling_type",
            "truncated_importance_sampling_ratio",
            "truncated_importance_sampling_ratio_min",
        )
    ),
    # -- checkpointing ----------------------------------------------------------------------------
    _m("checkpointing.enabled"),
    _m("checkpointing.save_period", "checkpointing.save_every_n_steps"),
    _m(
        "checkpointing.keep_top_k",
        "checkpointing.keep_last",
        note="the best by metric_name (and the newest), or the newest without one",
    ),
    _i("checkpointing.checkpoint_dir", "rlcore writes checkpoints to <logger.output_dir>/checkpoints"),
    _c(
        "checkpointing.metric_name",
        "checkpoint_metric",
        "checkpointing.metric_name",
        "val:accuracy → validation/accuracy, val:avg_length → validation/mean_generation_length (GRPO, "
        "distillation); in an SFT config val:val_loss → validation/loss; in a DPO config "
        "val:validation-<set>_<metric> (<set>: default, or the data.val_data_paths name) → validation/<metric> for "
        "loss, accuracy, preference_loss, sft_loss, rewards_chosen_mean, rewards_rejected_mean; others are errors",
    ),
    _c("checkpointing.higher_is_better", "checkpoint_metric", "checkpointing.higher_is_better", "as is"),
    _m(
        "checkpointing.checkpoint_must_save_by",
        note="'DD:HH:MM:SS' from the start of training: the step after which it has passed, or the next step would "
        "pass it, is saved and the run stops (NeMo-RL's TimeoutChecker)",
    ),
    _n("checkpointing.model_save_format", ("safetensors", None), "checkpoint format (rlcore writes safetensors)"),
    _i("checkpointing.save_consolidated", "rlcore's weights/ is always a consolidated Hugging Face checkpoint"),
    _n("checkpointing.save_optimizer", (True, None), "weights-only checkpoints"),
    _n(
        "checkpointing.pretrained_checkpoint",
        NONE_OR_EMPTY,
        "loading Megatron checkpoints (rlcore loads Hugging Face weights)",
    ),
    # -- logger, data, env and the rest -------------------------------------------------------------------
    _m("logger.log_dir", "logger.output_dir"),
    _m("logger.tensorboard_enabled", "logger.tensorboard"),
    *(
        _m(
            f"logger.{name}_enabled",
            note=f"needs rlcore[{name}]; --resume continues the same run; every "
            "metrics.jsonl row and the resolved config (docs/trackers.md)",
        )
        for name in ("wandb", "mlflow")
    ),
    *(
        _m("logger." + k)
        for k in ("wandb.project", "wandb.name", "mlflow.experiment_name", "mlflow.run_name", "mlflow.tracking_uri")
    ),
    _i("logger", LOGGING),
    _c(
        "data",
        "task",
        "data",
        "local files only: data_path (train and validation, or a split_validation_size "
        "share of train), input_key/output_key (a known dataset's columns by default), prompt_file, "
        "system_prompt_file, shuffle, env_name → env.name; a dataset NeMo-RL downloads is an error naming the "
        "data_path to give. In an SFT config: data_path (the early releases: train_data_path, val_data_path) → "
        "data.train.path / data.validation.path, ResponseDataset's input_key/output_key, a split naming the one "
        "split of a .jsonl/.csv/.parquet file ignored; the validation entry's row keys must be the train entry's. "
        "In a DPO config: the same files (the early releases: train_data_path, val_data_path; data.val_data_paths "
        "with one entry replaces the validation set), PreferenceDataset rows (HelpSteer3 and Tulu3Preference too) → "
        "data.messages_key 'context', BinaryPreferenceDataset's prompt_key → data.input_key (chosen_key / "
        "rejected_key must be 'chosen' / 'rejected'). NeMo-RL's image datasets (clevr-cogent, geometry3k) are "
        "hub datasets with data.image_key: their processor vlm_hf_data_processor is rlcore's way of building "
        "their samples (any other processor is an error for them, and it for any other dataset)",
    ),
    *(
        _c("data." + k, "sft_data", "sft." + k, "SFT configs (NeMo-RL's SFT reads it; GRPO's does not)")
        for k in ("add_bos", "add_eos", "add_generation_prompt")
    ),
    _c(
        "data.*.chat_key",
        "sft_data",
        "data.messages_key",
        "SFT configs (OpenAI-format rows; the early releases' "
        "data.chat_key too); the loss falls on the log's assistant messages",
    ),
    _n(
        "data.*.processor",
        ("sft_processor", None),
        "SFT configs: another processor than the one rlcore's SFT tokenizes rows with (GRPO configs: ignored)",
    ),
    _n(
        "data.*.system_key",
        (None,),
        "SFT configs: a system message from a column of the row (put it in the row's "
        "messages, or use system_prompt → data.system_prompt)",
    ),
    _n("data.*.tool_key", (None,), "SFT configs: tool definitions for the chat template"),
    _n("data.*.subset", (None,), "SFT configs: Hugging Face dataset subsets (rlcore reads local files)"),
    _i("data.*.system_prompt_file", "SFT configs: NeMo-RL's SFT never adds it (GRPO configs: data.system_prompt_file)"),
    _c(
        "data.max_input_seq_length",
        "sft_data",
        "data.max_input_seq_length",
        "as is: a prompt (GRPO, distillation) or sample (SFT; DPO: a pair) this long is cut to a few tokens and "
        "masked out of the loss, as NeMo-RL's processors do; one value for every split; null: ignored",
    ),
    _c(
        "env",
        "task",
        "env",
        "the run's environment (data env_name, else the first section of an installed "
        "environment): env.<name>.num_workers → env.num_workers; env.math.math_verify_impl hf_math_verify → "
        "env.math_cfg.verifier math_verify, dapo_math_verify → dapo (DAPO's grader); env.math.verifier_type other "
        "than math is an error; env.reward_model (a reward model scoring each conversation) → env.reward_model_cfg: "
        "model_name, checkpoint_path, batch_size, precision, max_model_len as they are, resources.gpus_per_node → "
        "resources.workers_per_node (taken off cluster.gpus_per_node on one node, its num_nodes off cluster.num_nodes "
        "on several), its policy keys (tokenizer, dtensor_cfg, ...) converted as policy's → "
        "env.reward_model_cfg.policy, reward_model_cfg other than {enabled: true, reward_model_type: bradley_terry}, "
        "dynamic_batching or sequence_packing on, a max_grad_norm, generation, or dtensor_cfg cpu_offload / "
        "activation_checkpointing are errors (NeMo-RL asserts them), processor, logprob_batch_size and "
        "offload_optimizer_for_logprob ignored; an installed plugin environment's env.<name>.* → env.<name>_cfg.* "
        "(validated by its config class); with an image dataset (NeMo-RL's VLM script) the section env_name names, "
        "and one named vlm, → the vlm environment: reward_functions → env.vlm_cfg.reward_functions, stop_strings "
        "ignored (read nowhere); a section no installed environment has, which no data entry names, is ignored",
    ),
    _c(
        "data_plane",
        "data_plane",
        "data_plane",
        "ignored: TransferQueue moves the same batches between the same steps (NeMo-RL's grpo_train_sync, "
        "parity-tested against grpo_train); with async_grpo refused, as NeMo-RL's run_grpo.py refuses it",
    ),
    _n(
        "teachers",
        NONE_OR_EMPTY,
        "several teachers (NeMo-RL's cross-tokenizer off-policy distillation, a "
        "projection matrix per teacher; rlcore distils on-policy from one teacher.model_name, of another tokenizer "
        "through distillation.teacher.tokenizer.name)",
    ),
    _c(
        "async_rl",
        "data_plane",
        "grpo.async_grpo",
        "NeMo-RL's single-controller asynchronous loop (run_grpo_single_controller.py), with data_plane.enabled "
        "(the loop that then runs): sampler in_order with max_lookahead_versions N > 0 → grpo.async_grpo enabled, "
        "max_trajectory_age_steps N, in_flight_weight_updates (its weight syncs never drain), and "
        "recompute_kv_cache_after_weight_updates as is; N = 0 is synchronous GRPO; other samplers, drop budgets, "
        "deadlines, stall_action abort, generation_fleet_health or generation_router enabled, and "
        "max_buffered_rollouts below the sampler's capacity are errors; the streaming, concurrency, diagnostics and "
        "disabled or report-only resiliency keys are ignored, saying why. Without data_plane.enabled it is ignored "
        "(no script of NeMo-RL reads it then)",
    ),
    _n("on_policy_distillation", (None,), "on-policy distillation"),
)
