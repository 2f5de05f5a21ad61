"""Sequence parallelism (``policy.megatron_cfg.sequence_parallel``) on megatron-core's local layer spec.

Under sequence parallelism the activations between tensor-parallel regions are split along the sequence over the
TP ranks: the embedding scatters them, the column-parallel linears all-gather their input and the row-parallel
linears reduce-scatter their output, all of which megatron-core's local spec already does. What it lacks is a norm:
its ``WrappedTorchNorm`` refuses ``sequence_parallel``. The norms here are PyTorch's, with one difference that
matters: a norm that sees only its rank's slice of the sequence gets only that slice's share of its weight
gradient, so its weight is marked ``sequence_parallel`` and megatron's ``finalize_model_grads`` sums those
gradients over the TP group (``_allreduce_non_tensor_model_parallel_grads``).

The q/k norms act after the column-parallel QKV projection, on the full sequence and this rank's heads, as without
sequence parallelism: they are not marked (megatron sums their gradients over TP by name, ``qk_layernorm``).
"""

from __future__ import annotations

from typing import Any

import torch


def _torch_norm(config: Any, hidden_size: int, eps: float) -> torch.nn.Module:
    if config.normalization == "RMSNorm":
        return torch.nn.RMSNorm(hidden_size, eps=eps)
    if config.normalization == "LayerNorm":
        return torch.nn.LayerNorm(hidden_size, eps=eps)
    raise NotImplementedError(f"normalization {config.normalization!r} (supported: RMSNorm, LayerNorm)")


class SequenceParallelNorm:
    """A hidden-state norm (input, pre-MLP and final): its parameters' gradients are summed over TP under
    sequence parallelism. Built by megatron's ``build_module`` with ``WrappedTorchNorm``'s arguments."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> torch.nn.Module:  # type: ignore[misc]
        norm = _torch_norm(config, hidden_size, eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]
        return norm


class HeadNorm:
    """A q/k norm: acts on the full sequence (after the QKV all-gather), so it is not marked ``sequence_parallel``."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> torch.nn.Module:  # type: ignore[misc]
        return _torch_norm(config, hidden_size, eps)


def sequence_parallel_spec(spec: Any, config: Any) -> Any:
    """``spec`` (a local-spec ``TransformerLayer`` ``ModuleSpec``) as the block spec of this pipeline stage with the
    norms above in place of ``WrappedTorchNorm``, the final norm included."""
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    layer = spec.submodules
    layer.input_layernorm = SequenceParallelNorm
    layer.pre_mlp_layernorm = SequenceParallelNorm
    attention = layer.self_attention.submodules
    for name in ("q_layernorm", "k_layernorm"):
        if getattr(attention, name) is not IdentityOp:
            setattr(attention, name, HeadNorm)
    layers = get_num_layers_to_build(config)  # this rank's pipeline stage
    return TransformerBlockSubmodules(layer_specs=[spec] * layers, layer_norm=SequenceParallelNorm)


__all__ = ["HeadNorm", "SequenceParallelNorm", "sequence_parallel_spec"]
