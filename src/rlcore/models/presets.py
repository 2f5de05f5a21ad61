"""Built-in models with the shapes of real ones (Qwen2.5-0.5B, Qwen3-0.6B, Llama-3.2-1B, Qwen3-30B-A3B, Qwen2.5-VL-3B).

Each preset is a set of :func:`rlcore.models.build.build_tiny_model` arguments
matching the real model's ``config.json``: layers, widths, heads, vocabulary
rows, tied embeddings, RoPE and RMSNorm settings. It has the real parameter
count (:data:`PARAMETER_COUNTS`), so memory, throughput and sharding behave as
with the real checkpoint; the weights are random and the tokenizer is the
byte-level one of the tiny models (259 tokens; the other embedding rows exist
but no text maps to them). Weights are fp32, the training default for master
weights. Nothing is downloaded; a preset is built once into the model cache
(about 4 bytes per parameter on disk).

The vision-language preset is in :data:`VLM_PRESETS`, a set of
:func:`rlcore.models.vlm.build_tiny_vlm` arguments (its vision token ids are
the byte-level tokenizer's, not the real ones).
"""

from __future__ import annotations

from typing import Any

_QWEN_ROPE_EPS = dict(rope_theta=1_000_000.0, rms_norm_eps=1e-6)

#: Build arguments of each preset (``policy.model_name: qwen2.5-0.5b`` resolves to one).
PRESETS: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": dict(
        arch="qwen2",
        hidden_size=896,
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        head_dim=64,
        intermediate_size=4864,
        vocab_size=151936,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
        **_QWEN_ROPE_EPS,
    ),
    "qwen3-0.6b": dict(
        arch="qwen3",
        hidden_size=1024,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=3072,
        vocab_size=151936,
        tie_word_embeddings=True,
        max_position_embeddings=40960,
        **_QWEN_ROPE_EPS,
    ),
    "llama-3.2-1b": dict(
        arch="llama",
        hidden_size=2048,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        intermediate_size=8192,
        vocab_size=128256,
        tie_word_embeddings=True,
        max_position_embeddings=131072,
        rope_theta=500_000.0,
        rms_norm_eps=1e-5,
        rope_scaling=dict(
            rope_type="llama3",
            factor=32.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
    ),
    # Mixture of experts: 128 experts of width 768 per layer, 8 routed per token (about 3.3B of 30.5B active).
    "qwen3-30b-a3b": dict(
        arch="qwen3_moe",
        hidden_size=2048,
        num_layers=48,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        intermediate_size=6144,
        vocab_size=151936,
        tie_word_embeddings=False,
        max_position_embeddings=40960,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        router_aux_loss_coef=0.001,
        norm_topk_prob=True,
        **_QWEN_ROPE_EPS,
    ),
}

#: Build arguments of the vision-language presets (:func:`rlcore.models.vlm.build_tiny_vlm`), as in the real
#: model's config.json: a 36-layer text decoder and a 32-block vision tower (windowed but for 4 full-attention blocks).
VLM_PRESETS: dict[str, dict[str, Any]] = {
    "qwen2.5-vl-3b": dict(
        arch="qwen2_5_vl",
        hidden_size=2048,
        num_layers=36,
        num_heads=16,
        num_kv_heads=2,
        intermediate_size=11008,
        vocab_size=151936,
        tie_word_embeddings=True,
        max_position_embeddings=128000,
        rope_theta=1_000_000.0,
        mrope_section=(16, 24, 24),
        rms_norm_eps=1e-6,
        vision_depth=32,
        vision_hidden_size=1280,
        vision_num_heads=16,
        vision_intermediate_size=3420,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=112,
        fullatt_block_indexes=(7, 15, 23, 31),
        tokens_per_second=2,
        min_pixels=56 * 56,
        max_pixels=28 * 28 * 1280,
    ),
}

#: Parameters of the real models (tied embeddings counted once); the presets have exactly these.
PARAMETER_COUNTS: dict[str, int] = {
    "qwen2.5-0.5b": 494_032_768,
    "qwen3-0.6b": 596_049_920,
    "llama-3.2-1b": 1_235_814_400,
    "qwen3-30b-a3b": 30_532_122_624,
    "qwen2.5-vl-3b": 3_754_622_976,
}


def preset(name: str, **overrides: Any) -> dict[str, Any]:
    """The build arguments of preset ``name``, with ``overrides`` applied (a copy).

    ``preset("llama-3.2-1b", num_layers=1, hidden_size=64, ...)`` keeps the
    architecture, RoPE and norm settings at a size that builds in a moment.
    """
    presets = {**PRESETS, **VLM_PRESETS}
    if name not in presets:
        raise KeyError(f"unknown preset {name!r}; expected one of {sorted(presets)}")
    args = dict(presets[name], **overrides)
    if isinstance(args.get("rope_scaling"), dict):
        args["rope_scaling"] = dict(args["rope_scaling"])
    return args
