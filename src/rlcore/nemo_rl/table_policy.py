"""The NeMo-RL → rlcore rules of the ``cluster`` and ``policy`` sections (:mod:`rlcore.nemo_rl.table`)."""

from __future__ import annotations

from rlcore.nemo_rl.rule import (  # the tables' shorthand: map, custom, ignore, neutral, gate
    DT,
    KERNEL,
    LOGGING,
    MEMORY,
    MG,
    MOE,
    NONE_OR_EMPTY,
    G,
    P,
    Rule,
    _c,
    _g,
    _i,
    _m,
    _n,
)

CLUSTER_AND_POLICY_RULES: tuple[Rule, ...] = (
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
    _i(
        "cluster.segment_size",
        "NVLink-domain placement (which nodes' GPUs NeMo-RL's placement groups take): where ranks run, not what "
        "they compute",
    ),
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
    _m(
        P + "hf_config_overrides",
        transform="none_is_empty",
        note="set on the model's config by the training backend and the vLLM engines alike; keys the config lacks "
        "or that change a parameter's shape are refused",
    ),
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
        P + "sequence_packing.fuse_loss",
        "one logprob pass over the packed logits instead of one per sequence (NeMo-RL's "
        "SequencePackingFusionLossWrapper: the same loss, numerically identical): " + KERNEL,
    ),
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
    _m(
        DT + "env_vars",
        P + "env_vars",
        transform="none_is_empty",
        note="set in every training worker of the policy, as NeMo-RL sets them in its DTensor workers; names "
        "rlcore's runtime sets (RANK, MASTER_ADDR, CUDA_VISIBLE_DEVICES, ...) are refused",
    ),
    _n(
        DT + "expert_parallel_size",
        (1, None),
        "expert parallelism on dtensor (its experts are FSDP-sharded; use megatron_cfg.expert_model_parallel_size)",
    ),
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
    _c(
        DT + "automodel_kwargs",
        "automodel",
        P + "freeze_vision_tower",
        "freeze_config.freeze_vision_tower → policy.freeze_vision_tower (the vision tower keeps its loaded weights); "
        "freeze_audio_tower ignored (rlcore's batches carry no audio), freeze_language_model true an error; NeMo "
        "Automodel's other options (backend, ...) are errors unless empty",
    ),
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
    # -- mixture of experts: honoured by rl-megatron (or refused there in one line, for a model with experts) ----
    *(
        _m(MG + k)
        for k in (
            "expert_tensor_parallel_size",
            "expert_model_parallel_size",
            "freeze_moe_router",
            "moe_router_dtype",
            "moe_router_load_balancing_type",
            "moe_router_bias_update_rate",
            "moe_aux_loss_coeff",
            "moe_expert_capacity_factor",
            "moe_token_dispatcher_type",
            "moe_enable_deepep",
        )
    ),
    _i(MG + "moe_permute_fusion", "a fused kernel for the same token permutation: " + KERNEL),
    _i(MG + "moe_grouped_gemm", "grouped GEMM computes the same expert products: " + KERNEL),
    _i(MG + "moe_shared_expert_overlap", "a schedule overlapping shared experts, the same numbers: " + KERNEL),
    _i(MG + "moe_per_layer_logging", LOGGING),
    # Routing that changes which experts a token reaches (DeepSeek-V3's expert bias and group-limited top-k): the
    # Qwen3-MoE routers rl-megatron builds have neither, so only their neutral values load.
    _n(MG + "moe_router_enable_expert_bias", (False, None), "expert-bias (aux-loss-free) routing"),
    _n(MG + "moe_router_num_groups", (None,), "group-limited routing"),
    _n(MG + "moe_router_group_topk", (None,), "group-limited routing"),
    *(
        _i(MG + k, MOE)
        for k in (
            "moe_flex_dispatcher_backend",
            "moe_hybridep_num_sms",
            "moe_pad_experts_for_cuda_graph_inference",
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
    _m(MG + "defer_fp32_logits"),
    _g(MG + "mtp_num_layers", "multi-token prediction", neutral=(0, None), covers=(MG + "mtp_*",)),
    _g(
        MG + "peft.enabled",
        "LoRA on the megatron backend (it does not declare 'lora'; train LoRA with "
        "dtensor: dtensor_cfg.lora_cfg, i.e. policy.lora)",
    ),
    _g(MG + "fp8_cfg.enabled", "FP8 training"),
    _n(MG + "fp8_cfg", (None,), "FP8 training"),
    _m(
        MG + "env_vars",
        P + "env_vars",
        transform="none_is_empty",
        note="set in every training worker of the policy, as NeMo-RL sets them in its Megatron workers",
    ),
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
    _i(
        MG + "optimizer.params_dtype",
        "megatron-core's optimizer never reads it (OptimizerConfig.params_dtype is only declared): its main "
        "weights are main_params_dtype, float32, which NeMo-RL does not set, and the model's dtype is "
        "policy.precision; rlcore's megatron optimizer keeps float32 main weights likewise",
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
    _m(
        G + "vllm_cfg.limit_mm_per_prompt",
        note="most images (per modality) in one prompt, as vLLM's limit_mm_per_prompt; vLLM's other multimodal "
        "settings (mm_processor_cache_gb) are vllm_kwargs, i.e. engine_kwargs",
    ),
    _i(
        G + "refit_transport",
        "how refit moves the weights (NIXL, ...): rlcore picks shared memory or CUDA IPC "
        "itself, and the weights that arrive are the same",
    ),
    _m(G + "vllm_kwargs", G + "vllm_cfg.engine_kwargs"),
    Rule(G + "vllm_cfg", "section", note="used when generation.backend is vllm", active_if=(G + "backend", ("vllm",))),
    _m(G + "vllm_cfg.tensor_parallel_size", note="an engine spans that many bundles, one engine rank in each"),
    _m(G + "vllm_cfg.precision"),
    _m(G + "vllm_cfg.max_model_len"),
    _m(G + "vllm_cfg.gpu_memory_utilization"),
    _m(G + "vllm_cfg.enforce_eager"),
    _m(
        G + "vllm_cfg.async_engine",
        note="vLLM's asynchronous engine: requests served continuously, per sample group; in-flight weight updates "
        "need it",
    ),
    _m(
        G + "vllm_cfg.expose_http_server",
        G + "expose_http_server",
        note="the run serves the policy on an OpenAI-compatible endpoint on 127.0.0.1 during rollouts (docs/agents.md)",
    ),
    _m(
        G + "vllm_cfg.http_server_serving_chat_kwargs.tool_parser",
        G + "tool_call_parser",
        note="vLLM's tool parser names; rlcore has 'hermes' (Hermes/Qwen <tool_call> JSON) and those plugins register",
    ),
    _n(
        G + "vllm_cfg.http_server_serving_chat_kwargs.enable_auto_tools",
        (True, None),
        "an endpoint that refuses tool_choice 'auto' (rlcore's lets the model call the request's tools)",
    ),
    _n(G + "vllm_cfg.http_server_serving_chat_kwargs.reasoning_parser", (None,), "reasoning parsers on the endpoint"),
    _n(G + "vllm_cfg.reasoning_parser_plugin", (None,), "reasoning parsers on the endpoint"),
    _n(G + "vllm_cfg.kv_cache_dtype", ("auto", None), "quantized KV cache"),
    _n(G + "vllm_cfg.pipeline_parallel_size", (1, None), "vLLM pipeline parallelism (use tensor_parallel_size)"),
    _n(G + "vllm_cfg.expert_parallel_size", (1, None), "vLLM expert parallelism"),
    _n(G + "vllm_cfg.num_last_layers_in_bf16", (0, None), "FP8 generation"),
    _n(G + "vllm_cfg.num_first_layers_in_bf16", (0, None), "FP8 generation"),
    _i(G + "vllm_cfg.use_deep_gemm", KERNEL),
    _i(G + "vllm_cfg.use_tqdm", "progress bars"),
    _i(G + "vllm_cfg.enable_vllm_metrics_logger", LOGGING),
    _i(G + "vllm_cfg.vllm_metrics_logger_interval", LOGGING),
)
