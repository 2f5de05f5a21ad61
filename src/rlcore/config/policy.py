"""Policy (training) settings; field names follow NeMo-RL's ``PolicyConfig``.

Values written as ``None`` that name another field's value (tokenizer name,
generation model) are filled in at validation as *derived* values: code
reading a loaded config sees them, ``rlcore config show`` prints them, and a
``model_copy(update=...)`` derives them again from the changed fields. Values
computed from several fields for a run (token budgets, the data-parallel size)
belong to the batch plan of :func:`rlcore.config.resolve`.

Each training backend's own settings (``dtensor_cfg``, ``megatron_cfg``, a
third party's ``<name>_cfg``) are defined by its plugin's config class, not
here; that class may derive values from the policy too, which it receives as
``owner`` in pydantic's validation context (see ``rlcore.config.backends``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, JsonValue, PositiveInt, Tag, field_validator, model_validator

from rlcore.config.base import SECTION_SUFFIX, SectionsModel, StrictModel, derived, fill_derived
from rlcore.config.generation import GenerationConfig
from rlcore.data.packing import PackingAlgorithm

Precision = Literal["float32", "bfloat16", "float16"]

#: NeMo-RL's selection of a training backend, as data: the default backend trains unless its ``<name>_cfg``
#: says ``enabled: false`` (NeMo-RL's ``dtensor_cfg.enabled`` defaults to true) ...
DEFAULT_TRAINING_BACKEND = "dtensor"
#: ... and with no section on, the fall-back backend trains; it also generates itself, so ``rlcore run`` falls
#: back to it when the default generation engine is not installed.
FALLBACK_TRAINING_BACKEND = "fsdp1"
#: ``json_schema_extra`` key of a ``policy`` field that only the named training backend reads (NeMo-RL keeps
#: those keys at the top of ``policy``); any other backend refuses a value other than the default.
ONLY_READ_BY = "only_read_by"


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

    name: str | None = Field(None, description="Tokenizer path or name; None (resolved at load) = policy.model_name.")
    chat_template: str | None = Field(
        None,
        description="Template applied where prompts are built (each prompt is one user message, with the "
        "generation prompt): None = passthrough (the prompt text unchanged), 'default' = the tokenizer's own "
        "template, '*.jinja' = that file, anything else = a Jinja template string.",
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="Extra variables for the chat template (e.g. {enable_thinking: true}); None = none."
    )


class _TokenBudgets(StrictModel):
    """Per-micro-batch token budgets shared by dynamic batching and sequence packing."""

    train_mb_tokens: PositiveInt | None = Field(
        None,
        description="Token budget per training micro-batch; None = train_micro_batch_size * "
        "max_total_sequence_length (the run's batch plan).",
    )
    logprob_mb_tokens: PositiveInt | None = Field(
        None,
        description="Token budget per logprob micro-batch; None = logprob_batch_size * "
        "max_total_sequence_length (the run's batch plan).",
    )


class SequencePackingConfig(_TokenBudgets):
    """Packing several sequences per micro-batch row, by token budget."""

    enabled: bool | None = Field(
        None,
        description="Pack several sequences into each micro-batch row. None (automatic): a GRPO run "
        "(rlcore run) packs its training and logprob passes when the training backend supports it and the "
        "config allows it (no dynamic batching); a Policy built directly does not pack.",
    )
    algorithm: PackingAlgorithm = Field(
        "modified_first_fit_decreasing", description="Bin-packing algorithm (rlcore.data.packing.ALGORITHMS)."
    )


class DynamicBatchingConfig(_TokenBudgets):
    """Micro-batches formed by token budget instead of a fixed sample count."""

    enabled: bool = Field(False, description="Form micro-batches by token budget instead of a fixed count.")
    sequence_length_round: PositiveInt = Field(
        64, description="Round padded sequence lengths up to a multiple of this."
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

    name: str = Field(
        description="Import path of a torch.optim.lr_scheduler class, e.g. 'torch.optim.lr_scheduler.LinearLR'."
    )
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
    Annotated[SinglePytorchSchedulerConfig, Tag("SinglePytorchSchedulerConfig")]
    | Annotated[SchedulerMilestones, Tag("SchedulerMilestones")],
    Discriminator(_scheduler_kind),
]


class LoRAConfig(StrictModel):
    """LoRA adapters on the policy's linear layers (NeMo-RL's ``dtensor_cfg.lora_cfg`` spelling).

    The base weights stay frozen and get no optimizer state; the reference
    model is the base model with the adapters switched off.
    """

    enabled: bool = Field(
        False,
        description="Train LoRA adapters instead of every weight (needs a training "
        "backend declaring the 'lora' capability).",
    )
    target_modules: list[str] = Field(
        default_factory=list,
        description="Linear layers to adapt: a module's own name ('q_proj') or a "
        "pattern over its dotted path ('*.layers.0.*.q_proj'). 'lm_head' adapts the output layer too (untied "
        "models only), also beside match_all_linear.",
    )
    exclude_modules: list[str] = Field(default_factory=list, description="Layers never adapted (same patterns).")
    match_all_linear: bool = Field(
        True,
        description="Adapt every linear layer of the decoder blocks (not the "
        "LM head); target_modules then only adds the LM head if it names it.",
    )
    dim: PositiveInt = Field(8, description="LoRA rank r.")
    alpha: float = Field(32, gt=0, description="Scale numerator: the adapter's output is multiplied by alpha/dim.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout probability inside the adapter (training only).")
    dropout_position: Literal["pre", "post"] = Field(
        "post", description="'pre': dropout on the adapter's input (PEFT's place); 'post': on its output."
    )
    lora_A_init: Literal["xavier", "uniform"] = Field(
        "xavier", description="Initialisation of A ('uniform' = kaiming-uniform, PEFT's default); B starts at 0."
    )
    refit: Literal["merged", "adapter"] = Field(
        "merged",
        description="How trained adapters reach the generation engine: 'merged' sends W + (alpha/dim) BA "
        "of the adapted layers (every weight only on the first refit); 'adapter' hands the engine only A and B, "
        "which it runs as LoRA modules over the base weights it loaded (needs a generation backend declaring "
        "'lora_adapter', e.g. vllm).",
    )
    save_merged: bool = Field(
        False,
        description="Checkpoints also hold the merged full weights (a Hugging Face "
        "model directory under 'merged/'), beside the PEFT-format adapter.",
    )

    @property
    def scaling(self) -> float:
        """The factor on the adapter's output, ``alpha / dim``."""
        return self.alpha / self.dim

    @model_validator(mode="after")
    def _something_to_adapt(self) -> LoRAConfig:
        if self.enabled and not self.match_all_linear and not self.target_modules:
            raise ValueError(
                "target_modules is empty while match_all_linear is false, so no layer would be "
                "adapted: list target_modules (e.g. [q_proj, v_proj]) or set match_all_linear: true"
            )
        return self


#: Environment variables each training worker's runtime sets (rlcore.distributed.worker_group): not the user's.
RUNTIME_ENV_VARS = frozenset(
    {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES"}
)


class PolicyConfig(SectionsModel):
    """The policy being trained and how.

    Each training backend's own settings are a ``<backend>_cfg`` sub-section
    (``dtensor_cfg``, ``megatron_cfg``, a third party's), collected into
    ``backend_sections`` and validated by that backend's config class when the
    config is resolved (:func:`rlcore.config.resolve`).
    """

    backend: str | None = Field(
        None,
        description="Training backend name. None selects the backend whose <name>_cfg section says "
        f"enabled: true, else '{DEFAULT_TRAINING_BACKEND}' unless its section says enabled: false, else "
        f"'{FALLBACK_TRAINING_BACKEND}' (NeMo-RL's rule).",
    )
    model_name: str = Field("tiny-llama", description="Local path or name of the model to train.")
    warm_start: str | None = Field(
        None,
        description="A config (a YAML path, or a shipped example's name) whose finished run this one starts from: "
        "rlcore run runs it first unless it has finished, then the model and tokenizer are its last checkpoint's "
        "weights/ and tokenizer/ (so policy.model_name is not set beside it).",
    )
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig, description="Tokenizer settings.")
    train_global_batch_size: PositiveInt = Field(
        8, description="Samples per optimizer step, across all data-parallel ranks."
    )
    train_micro_batch_size: PositiveInt = Field(1, description="Samples per forward/backward pass on one rank.")
    learning_rate: float = Field(5e-6, ge=0, description="Learning rate (default for the optimizer's lr).")
    logprob_batch_size: PositiveInt = Field(2, description="Samples per forward pass when computing logprobs.")
    logprob_chunk_size: PositiveInt | None = Field(
        None,
        description="Compute token logprobs (and their gradient) this many positions at a time, so the "
        "float32 working set is chunk x vocabulary instead of sequence x vocabulary; same numbers, less peak "
        "memory, a little more time. None = all positions at once. Needs a training backend declaring "
        "'chunked_logprobs' (NeMo-RL's policy.logprob_chunk_size).",
    )
    freeze_vision_tower: bool = Field(
        False,
        description="A vision-language model's vision tower keeps its loaded weights: no gradient, no "
        "optimizer state, not sent on refit (NeMo-RL's dtensor_cfg.automodel_kwargs.freeze_config."
        "freeze_vision_tower). Needs a vision-language model (docs/vision.md).",
    )
    generation: GenerationConfig | None = Field(
        None, description="Generation backend settings; None = no generation (training only)."
    )
    generation_batch_size: PositiveInt | None = Field(
        None,
        description="Most prompts per Hugging Face generate call when the training backend generates "
        "itself (fsdp1); None = a rank's whole shard at once. Engines such as vLLM batch on their own.",
    )
    precision: Precision = Field("float32", description="Training compute dtype.")
    dynamic_batching: DynamicBatchingConfig = Field(
        default_factory=DynamicBatchingConfig, description="Token-budget micro-batching (excludes sequence_packing)."
    )
    sequence_packing: SequencePackingConfig = Field(
        default_factory=SequencePackingConfig, description="Sequence packing (excludes dynamic_batching)."
    )
    make_sequence_length_divisible_by: PositiveInt = Field(
        1,
        description="Right-pad every training and logprob micro-batch to a sequence length that is a "
        "multiple of this (e.g. tp with sequence parallel); padding is masked and cut from results.",
    )
    max_total_sequence_length: PositiveInt = Field(
        512,
        description="Longest prompt + completion, in tokens: a longer sequence given to the policy is an "
        "error, and the GRPO loop cuts completions so prompt + completion fits.",
    )
    max_grad_norm: Annotated[float, Field(gt=0)] | Annotated[int, Field(gt=0)] | None = Field(
        1.0,
        description="Clip the global gradient norm to this. None disables clipping; "
        "the meaning is the same for every backend.",
    )
    max_consecutive_skipped_steps: PositiveInt | None = Field(
        3,
        description="An optimizer step whose loss or gradient norm is NaN or +-inf is skipped (no update, "
        "optimizer state untouched; counted in skipped_steps); after this many skipped in a row the run stops. "
        "None = never stop for it (every such step is still skipped).",
    )
    fsdp_offload_enabled: bool = Field(
        False,
        description=f"{FALLBACK_TRAINING_BACKEND} backend only: offload parameters to CPU (other backends: "
        "true is an error).",
        json_schema_extra={ONLY_READ_BY: FALLBACK_TRAINING_BACKEND},
    )
    activation_checkpointing_enabled: bool = Field(
        False,
        description=f"{FALLBACK_TRAINING_BACKEND} backend only: recompute activations in backward (other "
        "backends: true is an error; use the backend's own <name>_cfg.activation_checkpointing).",
        json_schema_extra={ONLY_READ_BY: FALLBACK_TRAINING_BACKEND},
    )
    hf_config_overrides: dict[str, JsonValue] = Field(
        default_factory=dict,
        description="Values set on the model's Hugging Face config before the training model is built "
        "(NeMo-RL's policy.hf_config_overrides; top-level keys replace the config's). A key the config does not "
        "have, or one that changes a parameter's shape, is refused; the generation engine applies the same "
        "(vLLM: hf_overrides). Backends: rlcore.training.hf_config.",
    )
    env_vars: dict[str, str] = Field(
        default_factory=dict,
        description="Environment variables set in every training worker process of this policy before its backend "
        "worker is built (NeMo-RL's dtensor_cfg.env_vars / megatron_cfg.env_vars), e.g. NCCL or allocator "
        "settings. Names the runtime sets itself (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, "
        "CUDA_VISIBLE_DEVICES, RLCORE_*) are refused.",
    )
    lora: LoRAConfig = Field(default_factory=LoRAConfig, description="LoRA adapters (off by default).")
    optimizer: PytorchOptimizerConfig = Field(
        default_factory=PytorchOptimizerConfig,
        description="torch optimizer (dtensor/fsdp1 backends); its "
        "kwargs are checked against the class's signature at load.",
    )
    scheduler: list[SchedulerEntry] | None = Field(
        None,
        description="torch lr schedulers; several are chained by a {name: milestones} entry "
        "(SequentialLR). None = constant learning rate.",
    )

    @field_validator("env_vars")
    @classmethod
    def _not_the_runtime_s(cls, env_vars: dict[str, str]) -> dict[str, str]:
        owned = sorted(name for name in env_vars if name in RUNTIME_ENV_VARS or name.startswith("RLCORE_"))
        if owned:
            raise ValueError(
                f"{', '.join(owned)}: set by rlcore for each worker (its rank, its rendezvous, its devices); "
                "remove them from policy.env_vars (the cluster section decides ranks and devices)"
            )
        return env_vars

    @property
    def training_backend(self) -> str:
        """The training backend this config selects (see ``backend``; several enabled sections are refused by
        :mod:`rlcore.config.rules`)."""
        if self.backend:
            return self.backend
        enabled = self.enabled_sections
        return enabled[0] if enabled else FALLBACK_TRAINING_BACKEND

    @property
    def enabled_sections(self) -> list[str]:
        """The backends whose ``<name>_cfg`` section is on: it says ``enabled: true``, or it is the default
        backend's and does not say ``enabled: false``."""
        on = [
            key[: -len(SECTION_SUFFIX)]
            for key, section in self.backend_sections.items()
            if section.get("enabled") is True
        ]
        default = self.backend_sections.get(DEFAULT_TRAINING_BACKEND + SECTION_SUFFIX, {})
        if default.get("enabled", True) is not False and DEFAULT_TRAINING_BACKEND not in on:
            on.append(DEFAULT_TRAINING_BACKEND)
        return on

    @model_validator(mode="after")
    def _derive_inherited(self) -> PolicyConfig:
        if self.tokenizer.name is None:
            fill_derived(self, tokenizer=derived(self.tokenizer, name=self.model_name))
        if self.generation is not None and self.generation.model_name is None:
            fill_derived(self, generation=derived(self.generation, model_name=self.model_name))
        return self
