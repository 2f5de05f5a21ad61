"""Model names rlcore builds locally, without any download (``tiny-llama``, ``qwen2.5-0.5b``, ...)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlcore.models.presets import PRESETS, VLM_PRESETS

#: Built on first use into the local cache (see :func:`rlcore.models.cache.tiny_model_path`):
#: the tiny models, then the real-size presets of :mod:`rlcore.models.presets`.
BUILTIN_MODELS: dict[str, dict[str, Any]] = {
    "tiny-llama": dict(
        arch="llama", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=256
    ),
    "tiny-qwen2": dict(
        arch="qwen2", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=256
    ),
    "tiny-qwen3": dict(
        arch="qwen3", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=256
    ),
    # Mixture of experts in the Qwen3-MoE shape: every MLP is 8 experts of width 64, top-2 routing, an aux loss.
    "tiny-qwen3-moe": dict(
        arch="qwen3_moe",
        hidden_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        intermediate_size=256,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        router_aux_loss_coef=0.001,
        norm_topk_prob=True,
    ),
    # A teacher for the distillation demo: random but sharp (large initial weights), so its top-k distributions
    # are far from a fresh student's and the KL has somewhere to fall.
    "tiny-teacher": dict(
        arch="qwen2",
        hidden_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        intermediate_size=256,
        initializer_range=0.2,
        seed=1,
    ),
    # Qwen2.5-VL: a 2-block vision tower (patch 14, 2x2 merge: a 56x56 image is 4 tokens) on a tiny-qwen2-sized decoder.
    "tiny-qwen2.5-vl": dict(
        arch="qwen2_5_vl",
        hidden_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=256,
        vision_depth=2,
        vision_hidden_size=64,
        vision_num_heads=2,
        vision_intermediate_size=128,
        patch_size=14,
        spatial_merge_size=2,
    ),
    **PRESETS,
    **VLM_PRESETS,
}


def resolve_model(name: str | None) -> str | None:
    """A local directory for a built-in name (built once, cached); anything else unchanged."""
    if name is None or name not in BUILTIN_MODELS or Path(name).exists():
        return name
    from rlcore.models.cache import tiny_model_path

    return tiny_model_path(**BUILTIN_MODELS[name])


def resolve_builtin_policy(policy: Any) -> Any:
    """The policy config with its built-in model names (model, tokenizer, generation model) as paths."""
    updates: dict[str, Any] = {
        "model_name": resolve_model(policy.model_name),
        "tokenizer": policy.tokenizer.model_copy(update={"name": resolve_model(policy.tokenizer.name)}),
    }
    if policy.generation is not None:
        updates["generation"] = policy.generation.model_copy(
            update={"model_name": resolve_model(policy.generation.model_name)}
        )
    return policy.model_copy(update=updates)


def resolve_builtin_models(cfg: Any) -> Any:
    """The config with every built-in model name (policy, tokenizer, generation) replaced by its path."""
    return cfg.model_copy(update={"policy": resolve_builtin_policy(cfg.policy)})
