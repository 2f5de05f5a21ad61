"""Policy (training) settings; field names follow NeMo-RL's ``PolicyConfig``.

Values written as ``None`` that name another field's value (tokenizer name,
Megatron lr and pipeline dtype, generation model) are filled in at validation
as *derived* values: code reading a loaded config sees them, ``rlcore config
show`` prints them, and a ``model_copy(update=...)`` derives them again from
the changed fields. Values computed from several fields for a run (token
budgets, the data-parallel size) belong to the batch plan of
:func:`rlcore.config.resolve`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, PositiveInt, Tag, model_validator

from rlcore.config.base import SectionsModel, StrictModel, derived, fill_derived
from rlcore.config.generation import GenerationConfig
from rlcore.data.packing import PackingAlgorithm

Precision = Literal["float32", "bfloat16", "float16"]


class TokenizerConfig(StrictModel):
    """Tokenizer to load, and how prompts are turned into model input.

    ``chat_template`` takes NeMo-RL's values with NeMo-RL's meaning: ``None``
    is the passthrough template (the prompt text as the task wrote it),
    ``'default'`` the tokenizer's own template, a path ending in ``.jinja``
    that file, anything else a Jinja template string. (NeMo-RL also uses the
    tokenizer's own template when the key is absent; rlcore's default is the
    passthrough, and ``rlcore config convert --from nemo-rl`` writes
    ``'default'`` for a NeMo-RL config that leaves the key out.)
    """

    name: str | None = Field(
        None, description="Tokenizer path or name; None (resolved at load) = policy.model_name."
    )
    chat_template: str | None = Field(
        None,
        description="Template applied where prompts are built (each prompt is one user message, with the "
        "generation prompt): None = passthrough (the prompt text unchanged), 'default' = the tokenizer's own "
        "template, '*.jinja' = that file, anything else = a Jinja template string.",
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="Extra variables for the chat template (e.g. {enable_thinking: true}); None = none."
    )


class DTensorConfig(StrictModel):
    """FSDP2 + DTensor training backend (TP, sequence parallel, CP)."""

    enabled: bool = Field(True, description="Train with the FSDP2 + DTensor backend ('dtensor').")
    cpu_offload: bool = Field(False, description="Offload parameters and gradients to CPU (FSDP2 CPUOffloadPolicy).")
    sequence_parallel: bool = Field(False, description="Shard activations along the sequence in TP regions.")
    activation_checkpointing: bool = Field(False, description="Recompute activations in the backward pass.")
    tensor_parallel_size: PositiveInt = Field(1, description="Tensor-parallel degree (tp).")
    context_parallel_size: PositiveInt = Field(1, description="Context-parallel degree (cp); > 1 needs CUDA.")
    custom_parallel_plan: str | None = Field(
        None, description="'module:object' path of a custom TP plan; None = the built-in plan for the architecture."
    )


class _TokenBudgets(StrictModel):
    """Per-micro-batch token budgets shared by dynamic batching and sequence packing."""

    train_mb_tokens: PositiveInt | None = Field(
        None, description="Token budget per training micro-batch; None = train_micro_batch_size * "
        "max_total_sequence_length (the run's batch plan)."
    )
    logprob_mb_tokens: PositiveInt | None = Field(
        None, description="Token budget per logprob micro-batch; None = logprob_batch_size * "
        "max_total_sequence_length (the run's batch plan)."
    )


class SequencePackingConfig(_TokenBudgets):
    """Packing several sequences per micro-batch row, by token budget."""

    enabled: bool | None = Field(
        None, description="Pack several sequences into each micro-batch row. None (automatic): a GRPO run "
        "(rlcore run) packs its training and logprob passes when the training backend supports it and the "
        "config allows it (no dynamic batching); a Policy built directly does not pack."
    )
    algorithm: PackingAlgorithm = Field(
        "modified_first_fit_decreasing", description="Bin-packing algorithm (rlcore.data.packing.ALGORITHMS)."
    )


class DynamicBatchingConfig(_TokenBudgets):
    """Micro-batches formed by token budget instead of a fixed sample count."""

    enabled: bool = Field(False, description="Form micro-batches by token budget instead of a fixed count.")
    sequence_length_round: PositiveInt = Field(64, description="Round padded sequence lengths up to a multiple of this.")


class MegatronOptimizerConfig(StrictModel):
    """megatron-core optimizer settings."""

    optimizer: Literal["adam", "sgd"] = Field("adam", description="Megatron optimizer type.")
    lr: float | None = Field(None, ge=0, description="Peak learning rate; None (resolved at load) = policy.learning_rate.")
    min_lr: float = Field(0.0, ge=0, description="Floor of the decayed learning rate.")
    weight_decay: float = Field(0.01, ge=0, description="Weight decay.")
    bf16: bool = Field(False, description="bf16 model weights (must match policy.precision 'bfloat16').")
    fp16: bool = Field(False, description="fp16 model weights (must match policy.precision 'float16').")
    params_dtype: Precision = Field(
        "float32",
        description="Dtype of the optimizer's main (master) weights: 'float32' (fp32 master weights, the "
        "standard mixed precision with a bf16/fp16 model), or policy.precision itself (low-precision master "
        "weights, which needs use_precision_aware_optimizer).",
    )
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="Adam beta1.")
    adam_beta2: float = Field(0.999, ge=0, lt=1, description="Adam beta2.")
    adam_eps: float = Field(1e-8, gt=0, description="Adam epsilon.")
    sgd_momentum: float = Field(0.9, ge=0, description="SGD momentum.")
    use_distributed_optimizer: bool = Field(False, description="Shard optimizer state across data-parallel ranks.")
    use_precision_aware_optimizer: bool = Field(False, description="Let the optimizer keep low-precision state.")
    clip_grad: float | None = Field(
        None,
        description="Leave unset: gradient clipping has one setting, policy.max_grad_norm. "
        "If given it must equal policy.max_grad_norm.",
    )


class MegatronSchedulerConfig(StrictModel):
    """megatron-core learning-rate and weight-decay schedule."""

    start_weight_decay: float = Field(0.01, ge=0, description="Weight decay at the first step.")
    end_weight_decay: float = Field(0.01, ge=0, description="Weight decay at the last step.")
    weight_decay_incr_style: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="How weight decay moves from start to end."
    )
    lr_decay_style: Literal["constant", "linear", "cosine", "inverse-square-root", "WSD"] = Field(
        "constant", description="Learning-rate decay schedule."
    )
    lr_decay_iters: PositiveInt | None = Field(None, description="Steps over which lr decays; None = no decay horizon.")
    lr_warmup_iters: int = Field(0, ge=0, description="Linear warm-up steps.")
    lr_warmup_init: float = Field(0.0, ge=0, description="Learning rate at the start of warm-up.")


class MegatronDDPConfig(StrictModel):
    """megatron-core distributed data parallel settings."""

    grad_reduce_in_fp32: bool = Field(False, description="Reduce gradients in fp32.")
    overlap_grad_reduce: bool = Field(False, description="Overlap gradient reduce-scatter with backward.")
    overlap_param_gather: bool = Field(False, description="Overlap parameter all-gather with forward.")
    average_in_collective: bool = Field(False, description="Average (rather than sum then scale) inside the collective.")
    use_custom_fsdp: bool = Field(False, description="Use Megatron's custom FSDP.")
    data_parallel_sharding_strategy: Literal["no_shard", "optim", "optim_grads", "optim_grads_params"] = Field(
        "optim_grads_params", description="What Megatron's custom FSDP shards across data-parallel ranks; "
        "only used with use_custom_fsdp (not supported), so any other value is rejected."
    )


class MegatronConfig(StrictModel):
    """megatron-core training backend (TP, PP, CP)."""

    enabled: bool = Field(False, description="Train with the megatron-core backend ('megatron').")
    empty_unused_memory_level: int = Field(0, ge=0, le=2, description="How aggressively to empty the CUDA cache (0-2).")
    activation_checkpointing: bool = Field(False, description="Recompute activations in the backward pass.")
    converter_type: str | None = Field(
        None, description="HF architecture used for weight conversion (e.g. 'LlamaForCausalLM'); None = from the model config."
    )
    tensor_model_parallel_size: PositiveInt = Field(1, description="Tensor-parallel degree (tp).")
    pipeline_model_parallel_size: PositiveInt = Field(1, description="Pipeline-parallel degree (pp).")
    num_layers_in_first_pipeline_stage: PositiveInt | None = Field(
        None, description="Layers on the first pipeline stage; None = even split."
    )
    num_layers_in_last_pipeline_stage: PositiveInt | None = Field(
        None, description="Layers on the last pipeline stage; None = even split."
    )
    context_parallel_size: PositiveInt = Field(1, description="Context-parallel degree (cp); > 1 needs CUDA.")
    pipeline_dtype: Precision | None = Field(
        None, description="Dtype of tensors sent between pipeline stages; None (resolved at load) = policy.precision."
    )
    sequence_parallel: bool = Field(False, description="Megatron sequence parallelism (needs TransformerEngine, i.e. a GPU).")
    optimizer: MegatronOptimizerConfig = Field(default_factory=MegatronOptimizerConfig, description="Megatron optimizer.")
    scheduler: MegatronSchedulerConfig = Field(default_factory=MegatronSchedulerConfig, description="Megatron lr/wd schedule.")
    distributed_data_parallel_config: MegatronDDPConfig = Field(
        default_factory=MegatronDDPConfig, description="Megatron DDP settings."
    )


class PytorchOptimizerConfig(StrictModel):
    """A torch optimizer by import path, for the dtensor and fsdp1 backends."""

    name: str = Field("torch.optim.AdamW", description="Import path of a torch.optim.Optimizer class.")
    kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments of the optimizer; 'lr' defaults (at load) to policy.learning_rate.",
    )


class SinglePytorchSchedulerConfig(StrictModel):
    """One torch lr scheduler by import path."""

    name: str = Field(description="Import path of a torch.optim.lr_scheduler class, e.g. 'torch.optim.lr_scheduler.LinearLR'.")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the scheduler.")


class SchedulerMilestones(StrictModel):
    """Chains the other entries of ``policy.scheduler`` with ``SequentialLR``.

    ``milestones[i]`` is the step at which scheduler ``i + 1`` takes over, so
    there is one milestone fewer than schedulers.
    """

    name: Literal["milestones"] = Field(description="Always 'milestones'.")
    milestones: list[PositiveInt] = Field(description="Increasing steps at which the next scheduler starts.")


def _scheduler_kind(value: Any) -> str:
    name = value.get("name") if isinstance(value, dict) else getattr(value, "name", None)
    return "SchedulerMilestones" if name == "milestones" else "SinglePytorchSchedulerConfig"


# Tags are the class names so error locations can be mapped back to dotted paths.
SchedulerEntry = Annotated[
    Union[
        Annotated[SinglePytorchSchedulerConfig, Tag("SinglePytorchSchedulerConfig")],
        Annotated[SchedulerMilestones, Tag("SchedulerMilestones")],
    ],
    Discriminator(_scheduler_kind),
]


class LoRAConfig(StrictModel):
    """LoRA adapters on the policy's linear layers (NeMo-RL's ``dtensor_cfg.lora_cfg`` spelling).

    The base weights stay frozen and get no optimizer state; the reference
    model is the base model with the adapters switched off.
    """

    enabled: bool = Field(False, description="Train LoRA adapters instead of every weight (needs a training "
                          "backend declaring the 'lora' capability).")
    target_modules: list[str] = Field(
        default_factory=list, description="Linear layers to adapt: a module's own name ('q_proj') or a "
        "pattern over its dotted path ('*.layers.0.*.q_proj'). 'lm_head' adapts the output layer too (untied "
        "models only), also beside match_all_linear.")
    exclude_modules: list[str] = Field(default_factory=list, description="Layers never adapted (same patterns).")
    match_all_linear: bool = Field(True, description="Adapt every linear layer of the decoder blocks (not the "
                                   "LM head); target_modules then only adds the LM head if it names it.")
    dim: PositiveInt = Field(8, description="LoRA rank r.")
    alpha: float = Field(32, gt=0, description="Scale numerator: the adapter's output is multiplied by alpha/dim.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout probability inside the adapter (training only).")
    dropout_position: Literal["pre", "post"] = Field(
        "post", description="'pre': dropout on the adapter's input (PEFT's place); 'post': on its output.")
    lora_A_init: Literal["xavier", "uniform"] = Field(
        "xavier", description="Initialisation of A ('uniform' = kaiming-uniform, PEFT's default); B starts at 0.")
    refit: Literal["merged", "adapter"] = Field(
        "merged", description="How trained adapters reach the generation engine: 'merged' sends W + (alpha/dim) BA "
        "of the adapted layers (every weight only on the first refit); 'adapter' hands the engine only A and B, "
        "which it runs as LoRA modules over the base weights it loaded (needs a generation backend declaring "
        "'lora_adapter', e.g. vllm).")
    save_merged: bool = Field(False, description="Checkpoints also hold the merged full weights (a Hugging Face "
                              "model directory under 'merged/'), beside the PEFT-format adapter.")

    @property
    def scaling(self) -> float:
        """The factor on the adapter's output, ``alpha / dim``."""
        return self.alpha / self.dim

    @model_validator(mode="after")
    def _something_to_adapt(self) -> "LoRAConfig":
        if self.enabled and not self.match_all_linear and not self.target_modules:
            raise ValueError("target_modules is empty while match_all_linear is false, so no layer would be "
                             "adapted: list target_modules (e.g. [q_proj, v_proj]) or set match_all_linear: true")
        return self


class PolicyConfig(SectionsModel):
    """The policy being trained and how.

    Third-party training backends put their settings in a ``<backend>_cfg``
    sub-section, collected into ``backend_sections``.
    """

    backend: str | None = Field(
        None,
        description="Training backend name. None selects 'megatron' if megatron_cfg.enabled, "
        "else 'dtensor' if dtensor_cfg.enabled, else 'fsdp1'.",
    )
    model_name: str = Field("tiny-llama", description="Local path or name of the model to train.")
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig, description="Tokenizer settings.")
    train_global_batch_size: PositiveInt = Field(8, description="Samples per optimizer step, across all data-parallel ranks.")
    train_micro_batch_size: PositiveInt = Field(1, description="Samples per forward/backward pass on one rank.")
    learning_rate: float = Field(5e-6, ge=0, description="Learning rate (default for the optimizer's lr).")
    logprob_batch_size: PositiveInt = Field(2, description="Samples per forward pass when computing logprobs.")
    logprob_chunk_size: PositiveInt | None = Field(
        None, description="Compute token logprobs (and their gradient) this many positions at a time, so the "
        "float32 working set is chunk x vocabulary instead of sequence x vocabulary; same numbers, less peak "
        "memory, a little more time. None = all positions at once. Needs a training backend declaring "
        "'chunked_logprobs' (NeMo-RL's policy.logprob_chunk_size)."
    )
    generation: GenerationConfig | None = Field(
        None, description="Generation backend settings; None = no generation (training only)."
    )
    generation_batch_size: PositiveInt | None = Field(
        None, description="Most prompts per Hugging Face generate call when the training backend generates "
        "itself (fsdp1); None = a rank's whole shard at once. Engines such as vLLM batch on their own."
    )
    precision: Precision = Field("float32", description="Training compute dtype.")
    dtensor_cfg: DTensorConfig = Field(default_factory=DTensorConfig, description="FSDP2/DTensor backend settings.")
    megatron_cfg: MegatronConfig = Field(default_factory=MegatronConfig, description="megatron-core backend settings.")
    dynamic_batching: DynamicBatchingConfig = Field(
        default_factory=DynamicBatchingConfig, description="Token-budget micro-batching (excludes sequence_packing)."
    )
    sequence_packing: SequencePackingConfig = Field(
        default_factory=SequencePackingConfig, description="Sequence packing (excludes dynamic_batching)."
    )
    make_sequence_length_divisible_by: PositiveInt = Field(
        1, description="Right-pad every training and logprob micro-batch to a sequence length that is a "
        "multiple of this (e.g. tp with sequence parallel); padding is masked and cut from results."
    )
    max_total_sequence_length: PositiveInt = Field(
        512, description="Longest prompt + completion, in tokens: a longer sequence given to the policy is an "
        "error, and the GRPO loop cuts completions so prompt + completion fits."
    )
    max_grad_norm: Annotated[float, Field(gt=0)] | Annotated[int, Field(gt=0)] | None = Field(
        1.0,
        description="Clip the global gradient norm to this. None disables clipping; "
        "the meaning is the same for every backend.",
    )
    fsdp_offload_enabled: bool = Field(
        False, description="fsdp1 backend only: offload parameters to CPU (other backends: true is an error).")
    activation_checkpointing_enabled: bool = Field(
        False, description="fsdp1 backend only: recompute activations in backward (other backends: true is an "
        "error; use dtensor_cfg/megatron_cfg.activation_checkpointing).")
    lora: LoRAConfig = Field(default_factory=LoRAConfig, description="LoRA adapters (off by default).")
    optimizer: PytorchOptimizerConfig = Field(
        default_factory=PytorchOptimizerConfig, description="torch optimizer (dtensor/fsdp1 backends); its "
        "kwargs are checked against the class's signature at load."
    )
    scheduler: list[SchedulerEntry] | None = Field(
        None,
        description="torch lr schedulers; several are chained by a {name: milestones} entry "
        "(SequentialLR). None = constant learning rate.",
    )

    @property
    def training_backend(self) -> str:
        """The training backend this config selects (see ``backend``)."""
        if self.backend:
            return self.backend
        if self.megatron_cfg.enabled:
            return "megatron"
        if self.dtensor_cfg.enabled:
            return "dtensor"
        return "fsdp1"

    @model_validator(mode="after")
    def _derive_inherited(self) -> "PolicyConfig":
        if self.tokenizer.name is None:
            fill_derived(self, tokenizer=derived(self.tokenizer, name=self.model_name))
        if self.generation is not None and self.generation.model_name is None:
            fill_derived(self, generation=derived(self.generation, model_name=self.model_name))
        megatron = self.megatron_cfg
        if megatron.optimizer.lr is None:
            megatron = derived(megatron, optimizer=derived(megatron.optimizer, lr=self.learning_rate))
        if megatron.pipeline_dtype is None:
            megatron = derived(megatron, pipeline_dtype=self.precision)
        fill_derived(self, megatron_cfg=megatron)
        return self
