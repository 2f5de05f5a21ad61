"""The NeMo-RL → rlcore mapping, as data: one :class:`Rule` per NeMo-RL key (or section).

The converter (:mod:`rlcore.nemo_rl.convert`) acts on these rules and
``docs/nemo-rl-mapping.md`` is generated from them (``rlcore config
nemo-rl-table``), so the documentation cannot drift from the behaviour.

Actions:

- ``map``: the value goes to ``target`` (a dotted rlcore path), unchanged
  unless ``transform`` names a conversion;
- ``custom``: a converter function (``handler``) reads this key together with
  others (cluster sizes, schedulers, advantages, ...); ``target`` says where
  the result lands;
- ``ignore``: rlcore has no use for it whatever its value (logging, ports,
  kernel and memory choices that do not change what is computed); reported;
- ``neutral``: ignored (and reported) while its value is one of ``neutral``,
  the values that change nothing; any other value is an error, because it
  would change training or generation and rlcore does not implement it;
- ``gate``: the switch of a feature rlcore lacks: off (a ``neutral`` value)
  ignores the whole section (``covers``, default: the switch's parent), on is
  an error;
- ``section``: a section used only when ``active_if`` holds (e.g. ``vllm_cfg``
  when the generation backend is vLLM); otherwise the whole section is
  ignored, except the keys in ``keep``.

Patterns: dotted paths; ``*`` matches any one key. A rule on a mapping
covers its whole subtree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

NONE_OR_EMPTY: tuple[Any, ...] = (None, {}, [])


@dataclass(frozen=True)
class Rule:
    nemo: str
    action: str
    target: str | None = None
    note: str = ""
    neutral: tuple[Any, ...] = ()
    transform: str | None = None
    handler: str | None = None
    covers: tuple[str, ...] | None = None
    active_if: tuple[str, tuple[Any, ...]] | None = None
    keep: tuple[str, ...] = ()


def _m(nemo: str, target: str | None = None, note: str = "", transform: str | None = None) -> Rule:
    return Rule(nemo, "map", target or nemo, note, transform=transform)


def _c(nemo: str, handler: str, target: str, note: str) -> Rule:
    return Rule(nemo, "custom", target, note, handler=handler)


def _i(nemo: str, note: str) -> Rule:
    return Rule(nemo, "ignore", None, note)


def _n(nemo: str, neutral: tuple[Any, ...], note: str) -> Rule:
    return Rule(nemo, "neutral", None, note, neutral=neutral)


def _g(nemo: str, note: str, neutral: tuple[Any, ...] = (False, None), covers: tuple[str, ...] | None = None) -> Rule:
    return Rule(nemo, "gate", None, note, neutral=neutral, covers=covers)


P, G, MG, DT = "policy.", "policy.generation.", "policy.megatron_cfg.", "policy.dtensor_cfg."
MOE = "MoE only: rlcore's backends build dense Llama/Qwen2/Qwen3 models (a MoE model fails at load)"
KERNEL = "kernel/fusion choice: the same computation, another implementation"
MEMORY = "memory placement only: what is computed does not change"
LOGGING = "rlcore logs to <logger.output_dir>/metrics.jsonl, TensorBoard, wandb and MLflow only"

RULES: tuple[Rule, ...] = (
    # -- cluster ------------------------------------------------------------------------------
    _c(
        "cluster.gpus_per_node",
        "cluster",
        "cluster.workers_per_node",
        "one training rank per GPU (cluster.use_gpu is set true); minus the generation GPUs when generation is "
        "not colocated on a single node",
    ),
    _c(
        "cluster.num_nodes",
        "cluster",
        "cluster.num_nodes",
        "minus the generation nodes when generation is not colocated on several nodes",
    ),
    _i("cluster.master_port_range_low", "ports: rlcore's workers pick free ports"),
    _i("cluster.master_port_range_high", "ports: rlcore's workers pick free ports"),
    _n("cluster.segment_size", (None,), "NVLink-domain placement"),
    # -- policy: model, batches, precision ------------------------------------------------------
    _m(P + "model_name"),
    _m(P + "tokenizer.name"),
    _c(
        P + "tokenizer.chat_template",
        "chat_template",
        P + "tokenizer.chat_template",
        "same values, same meaning (null = passthrough, 'default' = the tokenizer's own, a Jinja string); "
        "absent in NeMo-RL means the tokenizer's own: written as 'default'",
    ),
    _m(P + "tokenizer.chat_template_kwargs"),
    _n(P + "tokenizer.audio", NONE_OR_EMPTY, "multimodal processors"),
    _n(P + "tokenizer.video", NONE_OR_EMPTY, "multimodal processors"),
    _n(P + "tokenizer.use_processor", (False, None), "multimodal processors"),
    _n(P + "hf_config_overrides", NONE_OR_EMPTY, "model config overrides"),
    _m(P + "train_global_batch_size"),
    _m(P + "train_micro_batch_size"),
    _m(P + "logprob_batch_size"),
    _m(P + "generation_batch_size", note="bounds Hugging Face generate batches (fsdp1 generating itself)"),
    _m(P + "precision"),
    _m(P + "max_total_sequence_length"),
    _m(P + "make_sequence_length_divisible_by"),
    _c(
        P + "max_grad_norm",
        "clipping",
        P + "max_grad_norm",
        "null = no clipping; with megatron, NeMo-RL clips by megatron_cfg.optimizer.clip_grad, which then wins",
    ),
    _m(P + "logprob_chunk_size", note="positions per chunk of the logprob computation (same numbers, less memory)"),
    _i(P + "offload_optimizer_for_logprob", MEMORY),
    _i(P + "refit_buffer_size_gb", "refit transfer buffer size: " + MEMORY),
    _m(P + "fsdp_offload_enabled"),
    _m(P + "activation_checkpointing_enabled"),
    _g(P + "reward_model_cfg.enabled", "reward-model training"),
    _g(P + "draft.enabled", "draft (speculative) model training"),
    _g(P + "router_replay.enabled", "MoE router replay"),
    _n(P + "pretrained_checkpoint", NONE_OR_EMPTY, "loading Megatron checkpoints (rlcore loads Hugging Face weights)"),
    _n(P + "quant_cfg", (None,), "ModelOpt quantization"),
    _n(P + "quant_calib_data", (None,), "ModelOpt quantization"),
    _n(P + "quant_calib_size", (None,), "ModelOpt quantization"),
    _n(P + "quant_batch_size", (None,), "ModelOpt quantization"),
    _n(P + "quant_sequence_length", (None,), "ModelOpt quantization"),
    _i(P + "disable_modelopt_layer_spec", "ModelOpt layer spec selection"),
    # -- policy: optimizer and schedulers ---------------------------------------------------------
    _c(
        P + "optimizer",
        "optimizer",
        P + "optimizer",
        "name and kwargs as is (kwargs checked against the class); kwargs.lr also becomes policy.learning_rate; "
        "null = rlcore's default; with megatron ignored (megatron_cfg.optimizer applies, as in NeMo-RL)",
    ),
    _c(
        P + "scheduler",
        "scheduler",
        P + "scheduler",
        "the list as is; a '- milestones: [...]' entry becomes {name: milestones, milestones: [...]}; null = "
        "constant learning rate; with megatron ignored (megatron_cfg.scheduler applies, as in NeMo-RL)",
    ),
    # -- policy: dynamic batching and packing -------------------------------------------------------
    _m(P + "dynamic_batching.enabled"),
    _m(P + "dynamic_batching.train_mb_tokens"),
    _m(P + "dynamic_batching.logprob_mb_tokens"),
    _m(P + "dynamic_batching.sequence_length_round"),
    _m(
        P + "sequence_packing.enabled",
        transform="true_is_automatic",
        note="true = null (automatic): packing changes no number, only speed; a run packs where the training "
        "backend can (dtensor; megatron only with TransformerEngine, which rlcore does not use yet)",
    ),
    _m(P + "sequence_packing.train_mb_tokens"),
    _m(P + "sequence_packing.logprob_mb_tokens"),
    _m(P + "sequence_packing.algorithm"),
    _i(
        P + "sequence_packing.sequence_length_round",
        "padding granularity of packed kernels: rlcore packs exact lengths, which computes the same",
    ),
    # -- policy.dtensor_cfg ---------------------------------------------------------------------
    Rule(
        P + "dtensor_cfg",
        "section",
        note="used when dtensor_cfg.enabled is true; otherwise only 'enabled' is kept",
        active_if=(DT + "enabled", (True,)),
        keep=("enabled",),
    ),
    _m(DT + "enabled", note="training backend: megatron if megatron_cfg.enabled, else dtensor if this, else fsdp1"),
    _i(DT + "_v2", "picks NeMo-RL's DTensor worker implementation; rlcore has one dtensor worker"),
    _m(DT + "cpu_offload"),
    _m(DT + "sequence_parallel"),
    _m(DT + "activation_checkpointing"),
    _m(DT + "tensor_parallel_size"),
    _m(DT + "context_parallel_size", note="> 1 needs CUDA (an error before any process starts otherwise)"),
    _m(DT + "custom_parallel_plan"),
    _n(
        DT + "env_vars",
        (*NONE_OR_EMPTY, {"PYTORCH_CUDA_ALLOC_CONF": ""}),
        "per-worker environment variables (set "
        "them in the environment; an empty PYTORCH_CUDA_ALLOC_CONF, as NeMo-RL's dpo.yaml writes, is the default)",
    ),
    _n(DT + "expert_parallel_size", (1, None), "expert parallelism"),
    _n(DT + "dp_replicate_size", (1, None), "HSDP replication"),
    _i(DT + "defer_fsdp_grad_sync", "gradient-sync timing: " + MEMORY),
    _i(DT + "moe_parallelizer", MOE),
    *(
        _m(DT + "lora_cfg." + k, P + "lora." + k)
        for k in (
            "enabled",
            "target_modules",
            "exclude_modules",
            "match_all_linear",
            "dim",
            "alpha",
            "dropout",
            "dropout_position",
            "lora_A_init",
        )
    ),
    _i(DT + "lora_cfg.use_triton", KERNEL),
    _n(DT + "automodel_kwargs", NONE_OR_EMPTY, "NeMo Automodel options"),
    _i(DT + "clear_cache_every_n_steps", MEMORY),
    # -- policy.megatron_cfg --------------------------------------------------------------------
    Rule(
        P + "megatron_cfg",
        "section",
        note="used when megatron_cfg.enabled is true; otherwise only 'enabled' is kept",
        active_if=(MG + "enabled", (True,)),
        keep=("enabled",),
    ),
    _m(MG + "enabled"),
    *(
        _m(MG + k)
        for k in (
            "empty_unused_memory_level",
            "activation_checkpointing",
            "converter_type",
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "num_layers_in_first_pipeline_stage",
            "num_layers_in_last_pipeline_stage",
            "context_parallel_size",
            "pipeline_dtype",
            "sequence_parallel",
        )
    ),
    _i(MG + "force_reconvert_from_hf", "rlcore converts Hugging Face weights in memory at every start"),
    _n(MG + "recompute_granularity", ("full", None), "selective recomputation (rlcore recomputes whole layers)"),
    _n(MG + "recompute_modules", (None,), "selective recomputation"),
    _n(MG + "expert_tensor_parallel_size", (1, None), "expert tensor parallelism"),
    _n(MG + "expert_model_parallel_size", (1, None), "expert parallelism"),
    *(
        _i(MG + k, MOE)
        for k in (
            "freeze_moe_router",
            "moe_*",
            "hybridep_*",
            "inference_moe_token_dispatcher_type",
            "inference_grouped_gemm_backend",
        )
    ),
    *(
        _i(MG + k, KERNEL)
        for k in (
            "apply_rope_fusion",
            "bias_activation_fusion",
            "gradient_accumulation_fusion",
            "use_fused_weighted_squared_relu",
            "use_linear_ce_fusion_loss",
            "linear_ce_fusion_chunk_size",
            "attention_backend",
            "transformer_impl",
            "cuda_graph_impl",
        )
    ),
    _i(MG + "clear_memory_caches_before_refit", MEMORY),
    _i(MG + "cuda_graph_warmup_steps", "CUDA graph warm-up: " + KERNEL),
    _i(MG + "use_fused_linear_logprobs", KERNEL),
    _i(MG + "fused_linear_logprobs_chunk_size", "chunking of the fused logprob kernel: " + MEMORY),
    _i(
        MG + "checkpoint.async_save",
        "rlcore writes each checkpoint whole before training goes on; the saved state is the same",
    ),
    _i(
        MG + "checkpoint.ckpt_assume_constant_structure",
        "a Megatron distributed-checkpoint speed-up (rlcore saves Hugging Face safetensors)",
    ),
    _n(MG + "defer_fp32_logits", (False, None), "logits kept in low precision"),
    _g(MG + "mtp_num_layers", "multi-token prediction", neutral=(0, None), covers=(MG + "mtp_*",)),
    _g(
        MG + "peft.enabled",
        "LoRA on the megatron backend (it does not declare 'lora'; train LoRA with "
        "dtensor: dtensor_cfg.lora_cfg, i.e. policy.lora)",
    ),
    _g(MG + "fp8_cfg.enabled", "FP8 training"),
    _n(MG + "fp8_cfg", (None,), "FP8 training"),
    _n(MG + "env_vars", NONE_OR_EMPTY, "per-worker environment variables (set them in the environment)"),
    *(
        _m(MG + "optimizer." + k)
        for k in (
            "optimizer",
            "lr",
            "min_lr",
            "weight_decay",
            "bf16",
            "fp16",
            "adam_beta1",
            "adam_beta2",
            "adam_eps",
            "sgd_momentum",
            "use_distributed_optimizer",
            "use_precision_aware_optimizer",
        )
    ),
    _m(
        MG + "optimizer.params_dtype",
        note="dtype of the optimizer's main weights: float32 with a bf16 model is the standard mixed precision",
    ),
    _c(
        MG + "optimizer.clip_grad",
        "clipping",
        P + "max_grad_norm",
        "megatron clips by this in NeMo-RL: it becomes policy.max_grad_norm (0 or null = no clipping)",
    ),
    _i(MG + "optimizer.optimizer_cpu_offload", MEMORY),
    _i(MG + "optimizer.optimizer_offload_fraction", MEMORY),
    _m(MG + "scheduler.*"),
    _m(MG + "distributed_data_parallel_config.*"),
    # -- policy.generation --------------------------------------------------------------------
    _m(G + "backend", note="vllm → the rl-vllm plugin (fsdp1 generates when it is not installed)"),
    *(
        _m(G + k)
        for k in (
            "max_new_tokens",
            "temperature",
            "top_p",
            "stop_token_ids",
            "stop_strings",
            "model_name",
            "pad_token_id",
        )
    ),
    _m(G + "top_k", transform="top_k", note="-1 or 0 (vLLM's 'off') = null"),
    _m(G + "colocated.enabled"),
    _c(
        G + "colocated.resources",
        "cluster",
        G + "colocated.resources",
        "gpus_per_node → workers_per_node, num_nodes as is, when colocated.enabled is false (NeMo-RL's rules "
        "for which of the two to set); ignored while colocated",
    ),
    _i(G + "port_range_low", "ports: rlcore's engines pick free ports"),
    _i(G + "port_range_high", "ports: rlcore's engines pick free ports"),
    _i(G + "mcore_generation_config", "megatron-core inference engine (rlcore generates with vLLM or fsdp1)"),
    *(
        _m(
            G + f"{engine}_cfg",
            note="the settings of a generation engine rlcore ships no plugin for: kept for the "
            "plugin that provides it, whose config class validates them (without one, the run is refused at "
            "generation.backend and this section, saying that no rlcore plugin provides the engine)",
        )
        for engine in ("sglang", "trtllm", "dynamo")
    ),
    _i(
        G + "trtllm_kwargs",
        "TensorRT-LLM engine arguments: no rlcore engine reads them (backend trtllm is refused "
        "at generation.backend unless a plugin provides it)",
    ),
    _n(G + "vllm_cfg.limit_mm_per_prompt", NONE_OR_EMPTY, "multimodal inputs"),
    _i(
        G + "refit_transport",
        "how refit moves the weights (NIXL, ...): rlcore picks shared memory or CUDA IPC "
        "itself, and the weights that arrive are the same",
    ),
    _m(G + "vllm_kwargs", G + "vllm_cfg.engine_kwargs"),
    Rule(G + "vllm_cfg", "section", note="used when generation.backend is vllm", active_if=(G + "backend", ("vllm",))),
    _m(G + "vllm_cfg.tensor_parallel_size", note="rl-vllm supports 1 (more engines instead)"),
    _m(G + "vllm_cfg.precision"),
    _m(G + "vllm_cfg.max_model_len"),
    _m(G + "vllm_cfg.gpu_memory_utilization"),
    _m(G + "vllm_cfg.enforce_eager"),
    _n(G + "vllm_cfg.async_engine", (False, None), "async vLLM engine"),
    _n(G + "vllm_cfg.kv_cache_dtype", ("auto", None), "quantized KV cache"),
    _n(G + "vllm_cfg.pipeline_parallel_size", (1, None), "vLLM pipeline parallelism"),
    _n(G + "vllm_cfg.expert_parallel_size", (1, None), "vLLM expert parallelism"),
    _n(G + "vllm_cfg.num_last_layers_in_bf16", (0, None), "FP8 generation"),
    _n(G + "vllm_cfg.num_first_layers_in_bf16", (0, None), "FP8 generation"),
    _i(G + "vllm_cfg.use_deep_gemm", KERNEL),
    _i(G + "vllm_cfg.use_tqdm", "progress bars"),
    _i(G + "vllm_cfg.enable_vllm_metrics_logger", LOGGING),
    _i(G + "vllm_cfg.vllm_metrics_logger_interval", LOGGING),
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
        for algo in ("grpo", "sft", "dpo", "distillation")
    ),
    *(_m("grpo." + k) for k in ("val_at_start", "val_at_end", "max_val_samples", "val_batch_size")),
    _n("grpo.val_start_at", (-1, None), "starting validation at a later step"),
    _n("grpo.val_num_generations_per_prompt", (1, None), "several validation completions per prompt (pass@k)"),
    _n("grpo.stop_at_validation_metric", (None,), "stopping at a validation threshold"),
    _n("grpo.stop_at_validation_threshold", (None,), "stopping at a validation threshold"),
    *(_i(G + k, "rlcore validates greedily (docs/tasks.md)") for k in ("val_temperature", "val_top_p", "val_top_k")),
    _i(G + "refit_cfg", "refit transport: rlcore refits through its own synchronizer (docs/refit.md)"),
    _i(G + "real_quant_export_cpu_offload", MEMORY),
    _n(
        G + "vllm_cfg.logprobs_mode",
        ("processed_logprobs", None),
        "vLLM logprobs other than the sampling distribution's (rl-vllm returns processed_logprobs)",
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
    _n("grpo.async_grpo.in_flight_weight_updates", (False, None), "in-flight weight updates"),
    _n(
        "grpo.async_grpo.recompute_kv_cache_after_weight_updates",
        (False, None),
        "recomputing the KV cache after in-flight weight updates",
    ),
    _n("grpo.seq_logprob_error_threshold", (None,), "sequence logprob-error filtering"),
    _n("grpo.invalid_tool_call_advantage", (None,), "tool-call advantages"),
    _n("grpo.malformed_thinking_advantage", (None,), "thinking-tag advantages"),
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
    _n("checkpointing.checkpoint_must_save_by", (None,), "time-limited saving"),
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
        "rejected_key must be 'chosen' / 'rejected')",
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
        P + "max_total_sequence_length",
        "SFT configs: NeMo-RL masks a "
        "sample this long out of the loss, rlcore one longer than policy.max_total_sequence_length: equal is "
        "ignored, another value an error (GRPO configs: ignored)",
    ),
    _c(
        "env",
        "task",
        "env",
        "the run's environment (data env_name, else the first section of an installed "
        "environment): env.<name>.num_workers → env.num_workers; env.math.math_verify_impl hf_math_verify → "
        "env.math_cfg.verifier math_verify; an installed plugin environment's env.<name>.* → env.<name>_cfg.* "
        "(validated by its config class); a section no installed environment has is ignored",
    ),
    _g("data_plane.enabled", "TransferQueue data plane"),
    _n(
        "teachers",
        NONE_OR_EMPTY,
        "several teachers (NeMo-RL's cross-tokenizer off-policy distillation, a "
        "projection matrix per teacher; rlcore distils on-policy from one teacher.model_name, of another tokenizer "
        "through distillation.teacher.tokenizer.name)",
    ),
    _i(
        "async_rl",
        "NeMo-RL's single-controller async loop, which runs with data_plane (refused when enabled); "
        "rlcore's asynchronous GRPO is grpo.async_grpo",
    ),
    _n("on_policy_distillation", (None,), "on-policy distillation"),
)

#: Values that change nothing, for keys the table does not know (newer NeMo-RL releases).
UNKNOWN_NEUTRAL: tuple[Any, ...] = (None, False, 0, 0.0, "", "none", "None", {}, [])

__all__ = ["RULES", "Rule", "UNKNOWN_NEUTRAL"]
