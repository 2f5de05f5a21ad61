"""A randomly initialised causal LM (Llama, Qwen2, Qwen3, Qwen3-MoE) built from a config and saved as safetensors.

Tiny by default; the presets of :mod:`rlcore.models.presets` use the same
builder at the real sizes. Nothing is downloaded: the weights are drawn under a
fixed seed and the tokenizer is
:func:`rlcore.models.tokenizer.build_tiny_tokenizer`. torch and transformers
are imported inside the functions.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import Any

from rlcore.models.tokenizer import build_tiny_tokenizer

ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe")

#: Bump when the way models are built changes, so cached builds are not reused.
BUILD_VERSION = 1

#: Arguments added after the first release. Left at their default (``None``:
#: the transformers config's own default) they are not part of the cache key,
#: so models cached before they existed keep their directory.
LATER_ARGUMENTS = (
    "rope_theta",
    "rope_scaling",
    "rms_norm_eps",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "router_aux_loss_coef",
    "norm_topk_prob",
)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def resolve_dtype(dtype: Any):
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    resolved = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return resolved


def build_tiny_model(
    save_dir: str | os.PathLike,
    arch: str = "llama",
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    head_dim: int = 32,
    intermediate_size: int = 128,
    vocab_size: int | None = None,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    dtype: Any = "float32",
    max_position_embeddings: int = 512,
    initializer_range: float = 0.02,
    rope_theta: float | None = None,
    rope_scaling: dict[str, Any] | None = None,
    rms_norm_eps: float | None = None,
    num_experts: int | None = None,
    num_experts_per_tok: int | None = None,
    moe_intermediate_size: int | None = None,
    router_aux_loss_coef: float | None = None,
    norm_topk_prob: bool | None = None,
) -> str:
    """Build a randomly initialised causal LM and save it (+ tokenizer) to ``save_dir``.

    ``arch`` picks ``LlamaConfig`` / ``Qwen2Config`` (q/k/v biases) /
    ``Qwen3Config`` (q/k norms) / ``Qwen3MoeConfig`` (q/k norms, every MLP a
    mixture of ``num_experts`` experts of width ``moe_intermediate_size``, top
    ``num_experts_per_tok`` routing, a load-balancing aux loss weighted by
    ``router_aux_loss_coef``). Weights depend only on the arguments: they are
    drawn under ``seed`` inside a forked RNG, so the caller's global torch RNG
    is left as it was. ``vocab_size`` defaults to the tokenizer size rounded up
    to a multiple of 64 (padded rows, as real checkpoints have). ``head_dim``
    must be >= 32 (vLLM's attention kernels need it). ``rope_theta``,
    ``rope_scaling`` (e.g. ``{"rope_type": "llama3", "factor": 32.0, ...}``)
    and ``rms_norm_eps`` default to the transformers config's own defaults.
    Saved as safetensors; ``AutoModelForCausalLM.from_pretrained(path)``
    loads it. The weights are allocated once, in ``dtype``, and saved from
    there; the peak memory is the model plus, when tied, one transient
    vocabulary x hidden matrix (transformers allocates the output layer before
    tying it). Returns the path.
    """
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = build_tiny_tokenizer()
    config = _make_config(
        arch,
        tokenizer,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        tie_word_embeddings=tie_word_embeddings,
        max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        rms_norm_eps=rms_norm_eps,
        num_experts=num_experts,
        num_experts_per_tok=num_experts_per_tok,
        moe_intermediate_size=moe_intermediate_size,
        router_aux_loss_coef=router_aux_loss_coef,
        norm_topk_prob=norm_topk_prob,
    )
    torch_dtype = resolve_dtype(dtype)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    return save_model(model, tokenizer, save_dir)


def save_model(model: Any, tokenizer: Any, save_dir: str | os.PathLike) -> str:
    """Save a freshly built ``model`` (padding with the tokenizer's pad id when it generates) and ``tokenizer``
    into ``save_dir``, without transformers' progress bars; returns the directory."""
    import transformers

    model.generation_config.pad_token_id = tokenizer.pad_token_id
    save_dir = Path(save_dir)
    save_dir.mkdir(parents=True, exist_ok=True)
    progress = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    try:
        model.save_pretrained(str(save_dir))
    finally:
        if progress:
            transformers.utils.logging.enable_progress_bar()
    tokenizer.save_pretrained(str(save_dir))
    return str(save_dir)


def model_config(arch: str = "llama", **kwargs: Any):
    """The transformers config ``build_tiny_model(dir, arch, **kwargs)`` would save; nothing is built.

    For inspecting a model without its weights, e.g. counting parameters of
    ``AutoModelForCausalLM.from_config(model_config(...))`` on the meta device.
    """
    bound = inspect.signature(build_tiny_model).bind("<dir>", arch, **kwargs)
    bound.apply_defaults()
    args = dict(bound.arguments)
    for name in ("save_dir", "seed", "dtype"):
        args.pop(name)
    return _make_config(args.pop("arch"), build_tiny_tokenizer(), **args)


def _rope_parameters(rope_theta: float | None, rope_scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    """transformers' ``rope_parameters`` for the arguments; None leaves the config's default."""
    if rope_theta is None and rope_scaling is None:
        return None
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": 10000.0 if rope_theta is None else rope_theta}
    params.update(rope_scaling or {})
    return params


def _make_config(
    arch: str,
    tokenizer: Any,
    *,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    intermediate_size: int,
    vocab_size: int | None,
    tie_word_embeddings: bool,
    max_position_embeddings: int,
    initializer_range: float,
    rope_theta: float | None = None,
    rope_scaling: dict[str, Any] | None = None,
    rms_norm_eps: float | None = None,
    num_experts: int | None = None,
    num_experts_per_tok: int | None = None,
    moe_intermediate_size: int | None = None,
    router_aux_loss_coef: float | None = None,
    norm_topk_prob: bool | None = None,
):
    """Validate the shape and make the transformers config (arguments left None are not passed)."""
    import transformers

    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    if head_dim < 32:
        raise ValueError(f"head_dim must be >= 32 (vLLM needs it), got {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if vocab_size is None:
        vocab_size = round_up(len(tokenizer), 64)
    if vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer ({len(tokenizer)})")

    moe = {
        "num_experts": num_experts,
        "num_experts_per_tok": num_experts_per_tok,
        "moe_intermediate_size": moe_intermediate_size,
        "router_aux_loss_coef": router_aux_loss_coef,
        "norm_topk_prob": norm_topk_prob,
    }
    given_moe = sorted(name for name, value in moe.items() if value is not None)
    if given_moe and arch != "qwen3_moe":
        raise ValueError(f"{', '.join(given_moe)}: mixture-of-experts arguments need arch 'qwen3_moe', not {arch!r}")
    if num_experts is not None and num_experts_per_tok is not None and num_experts_per_tok > num_experts:
        raise ValueError(f"num_experts_per_tok ({num_experts_per_tok}) exceeds num_experts ({num_experts})")
    optional = {
        "rope_parameters": _rope_parameters(rope_theta, rope_scaling),
        "rms_norm_eps": rms_norm_eps,
        **moe,
    }
    config_cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "qwen3_moe": transformers.Qwen3MoeConfig,
    }[arch]
    return config_cls(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=initializer_range,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **{name: value for name, value in optional.items() if value is not None},
    )
