"""Tensor-parallel plans for Hugging Face causal LMs (Llama, Qwen2, Qwen3).

A plan maps module paths (``fnmatch`` patterns, as ``parallelize_module``
takes them) to DTensor parallel styles. The layout is the Megatron one:
q/k/v and gate/up are split by output features (column-wise), o/down by
input features (row-wise), so each attention/MLP block needs one reduction.

With sequence parallel the residual stream between blocks stays a DTensor
sharded along the sequence (``Shard(1)``): norms run on sequence shards, each
block all-gathers its input and reduce-scatters its output. The residual
stream must stay a DTensor (``use_local_output=False``) rather than a local
tensor because the model-level code of HF models reads
``inputs_embeds.shape[1]`` to build the causal mask, and a local shard would
report ``S / tp``.

A value model's head ``score`` is replicated (:func:`value_model_plan`).
The LM head always produces vocab-sharded logits (``Shard(-1)`` DTensor) so
logprobs are computed without gathering the vocabulary
(:mod:`rl_dtensor.vocab_parallel`).

Qwen3's per-head q/k norms see only this rank's heads. Declaring their input
as sharded along the head dimension (``SequenceParallel(sequence_dim=2)``)
makes the norm weight a replicated DTensor whose gradient DTensor sums over
tp ranks — the sum the per-head gradients need.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

Plan = dict[str, ParallelStyle]


def decoder_plan(sequence_parallel: bool, qk_norm: bool = False) -> Plan:
    """The plan of a Llama-style decoder (``model.layers.*``, ``model.norm``, ``lm_head``).

    Biases of q/k/v (Qwen2) are split with their weights by ``ColwiseParallel``.
    """
    if sequence_parallel:
        residual = Shard(1)
        plan: Plan = {
            "model.embed_tokens": RowwiseParallel(
                input_layouts=Replicate(), output_layouts=residual, use_local_output=False
            ),
            "model.layers.*.input_layernorm": SequenceParallel(),
            "model.layers.*.post_attention_layernorm": SequenceParallel(),
            "model.norm": SequenceParallel(),
            "model.layers.*.self_attn": PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": residual},
                desired_input_kwarg_layouts={"hidden_states": Replicate()},
                use_local_output=True,
            ),
            "model.layers.*.mlp": PrepareModuleInput(
                input_layouts=(residual,), desired_input_layouts=(Replicate(),), use_local_output=True
            ),
        }
    else:
        residual = Replicate()
        plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=residual)}
    # Row-wise outputs feed the residual add: keep them DTensors under SP, local tensors otherwise.
    keep_dtensor = sequence_parallel
    plan.update(
        {
            "model.layers.*.self_attn.q_proj": ColwiseParallel(),
            "model.layers.*.self_attn.k_proj": ColwiseParallel(),
            "model.layers.*.self_attn.v_proj": ColwiseParallel(),
            "model.layers.*.self_attn.o_proj": RowwiseParallel(
                output_layouts=residual, use_local_output=not keep_dtensor
            ),
            "model.layers.*.mlp.gate_proj": ColwiseParallel(),
            "model.layers.*.mlp.up_proj": ColwiseParallel(),
            "model.layers.*.mlp.down_proj": RowwiseParallel(output_layouts=residual, use_local_output=not keep_dtensor),
            "lm_head": ColwiseParallel(input_layouts=residual, output_layouts=Shard(-1), use_local_output=False),
        }
    )
    if qk_norm:
        # Input [B, S, local heads, head_dim]: sharded along the heads (dim 2).
        plan["model.layers.*.self_attn.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan["model.layers.*.self_attn.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan


#: model_type → plan factory(sequence_parallel). Mistral has Llama's module names.
PLANS: dict[str, Callable[[bool], Plan]] = {
    "llama": lambda sp: decoder_plan(sp),
    "mistral": lambda sp: decoder_plan(sp),
    "qwen2": lambda sp: decoder_plan(sp),
    "qwen3": lambda sp: decoder_plan(sp, qk_norm=True),
}


def value_model_plan(plan: Plan, sequence_parallel: bool) -> Plan:
    """``plan`` for a value model: Hugging Face's token-classification head ``score`` (``Linear(hidden, 1)``)
    instead of ``lm_head``.

    One output feature leaves nothing to split, so ``score`` stays replicated on every tp rank: its input, the
    final norm's output, is replicated without sequence parallel; with it, that output is sharded along the
    sequence and is all-gathered first, so every rank's head sees the whole sequence (its backward keeps each
    rank's slice of the gradient, which every tp rank computes whole)."""
    out = {pattern: style for pattern, style in plan.items() if pattern != "lm_head"}
    if sequence_parallel and "score" not in out:  # a custom plan's own entry for the head is kept
        out["score"] = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
        )
    return out


def import_plan(path: str, model: nn.Module, sequence_parallel: bool) -> Plan:
    """Resolve ``policy.dtensor_cfg.custom_parallel_plan``.

    ``path`` is ``"module:name"`` or ``"module.name"``; the object is a plan
    dict, or a callable ``(model, sequence_parallel) -> plan dict``.
    """
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError, ValueError) as err:
        raise ValueError(f"policy.dtensor_cfg.custom_parallel_plan: cannot import {path!r}: {err}") from err
    plan = obj(model, sequence_parallel) if callable(obj) else obj
    if not isinstance(plan, dict) or not all(isinstance(v, ParallelStyle) for v in plan.values()):
        raise ValueError(
            f"policy.dtensor_cfg.custom_parallel_plan: {path!r} must be (or return) a dict of "
            "module pattern -> torch.distributed.tensor.parallel.ParallelStyle"
        )
    return plan


def plan_for(model: nn.Module, sequence_parallel: bool, custom: str | None = None) -> Plan:
    """The user's plan if given, else the built-in plan of the model's architecture."""
    if custom:
        return import_plan(custom, model, sequence_parallel)
    model_type = getattr(model.config, "model_type", None)
    if model_type not in PLANS:
        raise ValueError(
            f"no built-in tensor-parallel plan for model_type {model_type!r} (known: "
            f"{sorted(PLANS)}); set policy.dtensor_cfg.custom_parallel_plan to 'module:plan'"
        )
    return PLANS[model_type](sequence_parallel)


def with_lora(plan: Plan, model: nn.Module) -> Plan:
    """``plan`` for a model whose linear layers may be LoRA-wrapped (:mod:`rlcore.training.lora`).

    A wrapped layer's style moves to its ``base_layer``, and the adapter is split
    to match: column-wise (output features split) shards ``lora_B`` the same way,
    with ``lora_A`` replicated (a ``SequenceParallel`` one when the input is
    sequence-sharded, as the LM head's is under SP); row-wise (input features split) shards
    ``lora_A``, whose reduced output feeds a replicated ``lora_B`` (a
    ``SequenceParallel`` one when the output is sequence-sharded, so its
    gradient is summed over the shards). Patterns are expanded to the paths
    they match, since a pattern may cover wrapped and plain layers alike.
    """
    import fnmatch

    from rlcore.training.lora import LoRALinear

    wrapped = {path for path, m in model.named_modules() if isinstance(m, LoRALinear)}
    if not wrapped:
        return plan
    out: Plan = {}
    for pattern, style in plan.items():
        hits = sorted(p for p in wrapped if fnmatch.fnmatchcase(p, pattern))
        if not hits:
            out[pattern] = style
            continue
        if not isinstance(style, (ColwiseParallel, RowwiseParallel)):
            raise ValueError(
                f"tensor-parallel plan entry {pattern!r} ({type(style).__name__}) covers LoRA-adapted "
                "linear layers; only ColwiseParallel/RowwiseParallel entries can"
            )
        for path in _plain_hits(model, pattern, wrapped):
            out[path] = style
        for path in hits:
            out[path + ".base_layer"] = style
            if isinstance(style, ColwiseParallel):
                out[path + ".lora_B"] = style
                if isinstance(style.input_layouts[0], Shard):
                    out[path + ".lora_A"] = SequenceParallel()
            else:
                out[path + ".lora_A"] = style
                if isinstance(style.output_layouts[0], Shard):
                    out[path + ".lora_B"] = SequenceParallel(use_local_output=style.use_local_output)
    return out


def _plain_hits(model: nn.Module, pattern: str, wrapped: set[str]) -> list[str]:
    """Paths ``pattern`` matches that are not LoRA-wrapped (nor inside a wrapper)."""
    import fnmatch

    return [
        path
        for path, _ in model.named_modules()
        if fnmatch.fnmatchcase(path, pattern)
        and path not in wrapped
        and not any(path.startswith(w + ".") for w in wrapped)
    ]
