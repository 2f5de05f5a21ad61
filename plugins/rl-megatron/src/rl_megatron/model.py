"""Build a megatron-core ``GPTModel`` that computes what the Hugging Face model computes.

The ``TransformerConfig`` is derived from the HF config (RMSNorm, SwiGLU,
rotary embeddings, GQA, Qwen2's QKV bias, Qwen3's q/k norm), with every
fusion that needs Apex or TransformerEngine turned off so that the local
(pure PyTorch) layer spec runs anywhere, CPU included. Dropout is zero, as in
the HF models. The parallel layout comes from ``policy.megatron_cfg``.
"""

from __future__ import annotations

from typing import Any

import torch

from rl_megatron.converter import ModelShape
from rlcore.training.worker_base import DTYPES


def rope_settings(hf_config: Any) -> dict[str, Any]:
    """GPTModel rotary arguments for the HF rope parameters (default and Llama-3 scaling)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    out: dict[str, Any] = {"rotary_base": theta, "rope_scaling": False}
    if rope_type == "default":
        return out
    # megatron-core implements Llama 3 scaling with the published constants only.
    llama3 = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    if rope_type == "llama3" and all(float(params.get(k, v)) == v for k, v in llama3.items()):
        out.update(rope_scaling=True, rope_scaling_factor=float(params.get("factor", 8.0)))
        return out
    raise NotImplementedError(
        f"rope parameters {params} are not supported by the megatron backend "
        "(supported: default rope, and llama3 scaling with the standard constants)"
    )


def transformer_config(shape: ModelShape, hf_config: Any, mcfg: Any, precision: str, use_cpu: bool) -> Any:
    """The ``TransformerConfig`` for ``shape`` under ``policy.megatron_cfg`` (``mcfg``)."""
    from megatron.core.transformer import TransformerConfig

    dtype = DTYPES[precision]
    recompute: dict[str, Any] = {}
    if mcfg.activation_checkpointing:
        recompute = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    return TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.intermediate_size,
        num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads,
        kv_channels=shape.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias,
        qk_layernorm=shape.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # Fusions that need Apex / TransformerEngine kernels: the local spec runs without them.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True,
        # Parallel layout.
        tensor_model_parallel_size=mcfg.tensor_model_parallel_size,
        pipeline_model_parallel_size=mcfg.pipeline_model_parallel_size,
        context_parallel_size=mcfg.context_parallel_size,
        sequence_parallel=mcfg.sequence_parallel,
        num_layers_in_first_pipeline_stage=mcfg.num_layers_in_first_pipeline_stage,
        num_layers_in_last_pipeline_stage=mcfg.num_layers_in_last_pipeline_stage,
        pipeline_dtype=DTYPES[mcfg.pipeline_dtype or precision],
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=use_cpu,
        # The weights are overwritten from the HF checkpoint right after construction, but
        # megatron-core marks TP-sharded parameters (``tensor_model_parallel``, ``partition_dim``)
        # only inside its initialisers: without them the gradient norm counts every TP shard as
        # a replica and drops all but rank 0's.
        perform_initialization=True,
        # rlcore's loss is already normalised by the global token/sequence count of the
        # step: the schedule must neither divide it by the number of micro-batches nor
        # scale gradients by the data-parallel size (design.md §2.3).
        calculate_per_token_loss=True,
        **recompute,
        **moe_settings(shape, mcfg),
    )


def moe_settings(shape: ModelShape, mcfg: Any) -> dict[str, Any]:
    """``TransformerConfig`` fields of a Qwen3-MoE-style model: softmax top-k routing (renormalised over the
    chosen experts when ``norm_topk_prob``: megatron's top-k-then-softmax is exactly that, and softmax-then-top-k
    is its ``pre_softmax``), experts run one after another (no grouped GEMM without TransformerEngine).

    megatron's own aux loss is off: it normalises differently from Hugging Face's (per layer, divided by top-k),
    so rlcore adds Hugging Face's loss itself (:mod:`rl_megatron.moe`)."""
    if not shape.is_moe:
        return {}
    return {
        "num_moe_experts": shape.num_experts,
        "moe_router_topk": shape.moe_topk,
        "moe_ffn_hidden_size": shape.moe_intermediate_size,
        "moe_router_score_function": "softmax",
        "moe_router_pre_softmax": not shape.norm_topk_prob,
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        "moe_router_dtype": mcfg.moe_router_dtype,
        "moe_token_dispatcher_type": mcfg.moe_token_dispatcher_type,
        "moe_grouped_gemm": False,
        "moe_permute_fusion": False,
        "moe_expert_capacity_factor": None,
        "expert_model_parallel_size": mcfg.expert_model_parallel_size,
        "expert_tensor_parallel_size": mcfg.expert_tensor_parallel_size,
    }


def layer_offset(config: Any, pp_rank: int) -> int:
    """Global index of the first decoder layer on pipeline stage ``pp_rank``."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    return get_transformer_layer_offset(config, vp_stage=None, pp_rank=pp_rank)


def build_gpt_model(shape: ModelShape, config: Any, hf_config: Any, pre_process: bool, post_process: bool) -> Any:
    """One pipeline stage of the GPTModel (local layer spec: no TransformerEngine needed); a value model's last
    stage ends in :class:`rl_megatron.value_head.ValueHead` instead of the vocabulary output layer."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from rl_megatron.sdpa_attention import SdpaDotProductAttention

    spec = get_gpt_layer_local_spec(
        num_experts=shape.num_experts or None, qk_layernorm=shape.qk_norm, normalization="RMSNorm"
    )
    spec.submodules.self_attention.submodules.core_attention = SdpaDotProductAttention  # fused, not [s, s] in fp32
    if config.sequence_parallel:
        from rl_megatron.sequence_parallel import sequence_parallel_spec

        spec = sequence_parallel_spec(spec, config)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=shape.padded_vocab_size(config.tensor_model_parallel_size),
        max_sequence_length=getattr(hf_config, "max_position_embeddings", 4096),
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=shape.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_percent=1.0,
        parallel_output=True,
        **rope_settings(hf_config),
    )
    if config.context_parallel_size > 1:
        from megatron.core import parallel_state

        from rl_megatron.context_parallel import rotary_at_local_positions

        cp_rank = parallel_state.get_context_parallel_rank()
        rotary_at_local_positions(model.rotary_pos_emb, config.context_parallel_size, cp_rank)
    if shape.value_head:  # the last stage's output layer becomes the value head (before DDP wraps the model)
        from rl_megatron.value_head import install_value_head

        install_value_head(model, config)
    return model


__all__ = ["DTYPES", "build_gpt_model", "layer_offset", "moe_settings", "rope_settings", "transformer_config"]
