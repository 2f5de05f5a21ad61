"""Hugging Face ↔ megatron-core weights for Llama / Qwen2 / Qwen3-style decoders.

megatron-core ships no converter, so this is the mapping, written from the two
models' definitions (GPTModel with the local layer spec on one side,
``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM`` on the
other). Every Megatron parameter is made of one or more HF tensors
(:class:`ParamMapping`), with a layout (``kind``) that says how it is split
over tensor-parallel ranks:

- ``replicated``: norms (incl. Qwen3's per-head q/k norms): every TP rank
  holds the whole tensor.
- ``vocab``: word embeddings and the output layer, split by rows (the
  vocabulary), zero-padded to a multiple of the TP size first.
- ``column`` / ``row``: ``linear_proj`` and ``linear_fc2`` are row-parallel
  (split along the input dimension, dim 1).
- ``qkv``: the fused ``linear_qkv`` (weight and Qwen2's bias). Megatron groups
  it per KV head: for each KV group, its ``num_heads / num_kv_heads`` query
  heads, then its key head, then its value head ([q…q k v] per group). TP
  ranks take whole groups, so ``num_kv_heads`` must be divisible by TP.
- ``gate_up``: SwiGLU ``linear_fc1``. Each TP rank's shard is
  ``[gate shard; up shard]`` — *not* a slice of the full ``[gate; up]``.

Names are global (``decoder.layers.<global index>``); the worker maps them to
its pipeline stage's local layer indices. Conversions are pure tensor
reshuffles: HF → Megatron → HF is bit-exact.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

#: converter_type values (HF architecture names) and the features of each.
ARCHITECTURES = {
    "LlamaForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "Qwen2ForCausalLM": {"qkv_bias": True, "qk_norm": False},
    "Qwen3ForCausalLM": {"qkv_bias": False, "qk_norm": True},
    "Qwen3MoeForCausalLM": {"qkv_bias": False, "qk_norm": True},
}


@dataclass(frozen=True)
class ModelShape:
    """What the mapping needs to know about the model (read from the HF config)."""

    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    #: Mixture of experts (every decoder layer's MLP; 0 experts = a dense model).
    num_experts: int = 0
    moe_topk: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.0
    #: A value model (``model_head='value'``): the trunk plus HF's token-classification ``score`` head
    #: (``Linear(hidden, 1)`` with bias) in place of the vocabulary output layer, never tied to the embeddings.
    value_head: bool = False

    @classmethod
    def from_hf_config(cls, hf_config: Any, converter_type: str | None = None, value_head: bool = False) -> ModelShape:
        """Read the shape from an HF config; ``converter_type`` overrides ``hf_config.architectures[0]``. A value
        model reads a causal LM's config or a token-classification one (``Qwen2ForTokenClassification``: the same
        trunk)."""
        arch = converter_type or (getattr(hf_config, "architectures", None) or [None])[0]
        if value_head and arch is not None:
            from rl_megatron.value_head import causal_lm_architecture

            arch = causal_lm_architecture(arch)
        if arch not in ARCHITECTURES:
            raise ValueError(
                f"policy.megatron_cfg.converter_type: no weight mapping for {arch!r}; "
                f"supported: {sorted(ARCHITECTURES)}"
            )
        features = ARCHITECTURES[arch]
        heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        for flag in ("attention_bias", "mlp_bias", "use_sliding_window"):  # not in these models' Megatron form
            if getattr(hf_config, flag, False):
                raise ValueError(f"{arch} with {flag}=True is not supported by the megatron backend")
        if getattr(hf_config, "hidden_act", "silu") != "silu":
            raise ValueError(f"{arch} with hidden_act={hf_config.hidden_act!r} is not supported (SwiGLU needs 'silu')")
        moe = _moe_fields(hf_config, arch)
        return cls(
            architecture=arch,
            num_layers=hf_config.num_hidden_layers,
            hidden_size=hf_config.hidden_size,
            num_heads=heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            intermediate_size=hf_config.intermediate_size,
            vocab_size=hf_config.vocab_size,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)) and not value_head,
            qkv_bias=features["qkv_bias"],
            qk_norm=features["qk_norm"],
            value_head=value_head,
            **moe,
        )

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def padded_vocab_size(self, tp_size: int) -> int:
        """The vocabulary rounded up to a multiple of ``tp_size`` (each rank holds an equal slice)."""
        return -(-self.vocab_size // tp_size) * tp_size

    def check_tp(self, tp_size: int) -> None:
        """Raise ValueError if the model cannot be split over ``tp_size`` ranks."""
        path = "policy.megatron_cfg.tensor_model_parallel_size"
        sizes = [("num_key_value_heads", self.num_kv_heads), ("num_attention_heads", self.num_heads)]
        if not self.is_moe:  # experts are not split over TP (expert_tensor_parallel_size 1)
            sizes.append(("intermediate_size", self.intermediate_size))
        for what, n in sizes:
            if n % tp_size:
                raise ValueError(
                    f"{path}: {tp_size} does not divide the model's {what} ({n}); "
                    f"choose a tensor-parallel size that divides it"
                )

    def check_ep(self, ep_size: int) -> None:
        """Raise ValueError if the experts cannot be split over ``ep_size`` ranks."""
        path = "policy.megatron_cfg.expert_model_parallel_size"
        if ep_size > 1 and not self.is_moe:
            raise ValueError(f"{path}: is {ep_size} but {self.architecture} has no experts: set it to 1")
        if self.is_moe and self.num_experts % ep_size:
            raise ValueError(
                f"{path}: {ep_size} does not divide the model's {self.num_experts} experts; choose a divisor"
            )


def _moe_fields(hf_config: Any, arch: str) -> dict[str, Any]:
    """The mixture-of-experts fields of :class:`ModelShape` (none for a dense model)."""
    experts = getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None) or 0
    if not experts:
        return {}
    sparse_step = getattr(hf_config, "decoder_sparse_step", 1)
    dense_layers = list(getattr(hf_config, "mlp_only_layers", None) or [])
    if sparse_step != 1 or dense_layers:
        raise ValueError(
            f"{arch} with decoder_sparse_step={sparse_step}, mlp_only_layers={dense_layers} is not supported by the "
            "megatron backend: every decoder layer must be a mixture of experts"
        )
    if getattr(hf_config, "shared_expert_intermediate_size", 0):
        raise ValueError(f"{arch} with shared experts is not supported by the megatron backend")
    return {
        "num_experts": int(experts),
        "moe_topk": int(hf_config.num_experts_per_tok),
        "moe_intermediate_size": int(hf_config.moe_intermediate_size),
        "norm_topk_prob": bool(getattr(hf_config, "norm_topk_prob", True)),
        "router_aux_loss_coef": float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0),
    }


@dataclass(frozen=True)
class ParamMapping:
    """One Megatron parameter (global name) and the HF tensors it is made of."""

    megatron: str
    hf: tuple[str, ...]
    kind: str  # replicated | vocab | row | qkv | gate_up | expert_gate_up | expert
    layer: int | None = None  # global decoder layer index, None for embeddings / final norm / output layer
    expert: int | None = None  # global expert index of an expert's weight


def expert_mappings(shape: ModelShape, layer: int) -> list[ParamMapping]:
    """The router and the experts of MoE layer ``layer``: HF's per-expert names <-> megatron's SequentialMLP
    ``local_experts`` (named here by *global* expert index; the worker maps them to its EP rank's local ones).
    Experts are not split over TP (expert_tensor_parallel_size 1)."""
    m, h = f"decoder.layers.{layer}.mlp.", f"model.layers.{layer}.mlp."
    out = [ParamMapping(m + "router.weight", (h + "gate.weight",), "replicated", layer)]
    for e in range(shape.num_experts):
        me, he = f"{m}experts.local_experts.{e}.", f"{h}experts.{e}."
        out += [
            ParamMapping(
                me + "linear_fc1.weight",
                (he + "gate_proj.weight", he + "up_proj.weight"),
                "expert_gate_up",
                layer,
                e,
            ),
            ParamMapping(me + "linear_fc2.weight", (he + "down_proj.weight",), "expert", layer, e),
        ]
    return out


def layer_mappings(shape: ModelShape, layer: int) -> list[ParamMapping]:
    """The Megatron parameters of decoder layer ``layer`` (global index), in HF order."""
    m, h = f"decoder.layers.{layer}.", f"model.layers.{layer}."
    attn = [
        ParamMapping(
            m + "self_attention.linear_qkv.weight",
            (h + "self_attn.q_proj.weight", h + "self_attn.k_proj.weight", h + "self_attn.v_proj.weight"),
            "qkv",
            layer,
        )
    ]
    if shape.qkv_bias:
        attn.append(
            ParamMapping(
                m + "self_attention.linear_qkv.bias",
                (h + "self_attn.q_proj.bias", h + "self_attn.k_proj.bias", h + "self_attn.v_proj.bias"),
                "qkv",
                layer,
            )
        )
    attn.append(ParamMapping(m + "self_attention.linear_proj.weight", (h + "self_attn.o_proj.weight",), "row", layer))
    if shape.qk_norm:
        attn += [
            ParamMapping(
                m + "self_attention.q_layernorm.weight", (h + "self_attn.q_norm.weight",), "replicated", layer
            ),
            ParamMapping(
                m + "self_attention.k_layernorm.weight", (h + "self_attn.k_norm.weight",), "replicated", layer
            ),
        ]
    mlp = (
        expert_mappings(shape, layer)
        if shape.is_moe
        else [
            ParamMapping(
                m + "mlp.linear_fc1.weight", (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"), "gate_up", layer
            ),
            ParamMapping(m + "mlp.linear_fc2.weight", (h + "mlp.down_proj.weight",), "row", layer),
        ]
    )
    norms = [
        ParamMapping(m + "input_layernorm.weight", (h + "input_layernorm.weight",), "replicated", layer),
        ParamMapping(m + "pre_mlp_layernorm.weight", (h + "post_attention_layernorm.weight",), "replicated", layer),
    ]
    return attn + mlp + norms


def all_mappings(shape: ModelShape) -> list[ParamMapping]:
    """Every Megatron parameter of the whole model, in HF state-dict order.

    With tied embeddings there is no ``output_layer.weight`` entry: the output
    layer reuses the word embeddings (on a pipeline's last stage Megatron keeps
    a synchronised copy; see :func:`output_copy_mapping`).
    """
    out = [ParamMapping("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab")]
    for layer in range(shape.num_layers):
        out += layer_mappings(shape, layer)
    out.append(ParamMapping("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated"))
    if shape.value_head:
        out += value_head_mappings()
    elif not shape.tie_word_embeddings:
        out.append(ParamMapping("output_layer.weight", ("lm_head.weight",), "vocab"))
    return out


def value_head_mappings() -> list[ParamMapping]:
    """A value model's head (megatron's ``output_layer`` slot, :mod:`rl_megatron.value_head`) ⇄ HF's ``score``."""
    from rl_megatron.value_head import value_head_names

    return [ParamMapping(m, (h,), "replicated") for m, h in value_head_names().items()]


def output_copy_mapping() -> ParamMapping:
    """The last pipeline stage's copy of tied word embeddings (loaded from, never exported to, HF)."""
    return ParamMapping("output_layer.weight", ("model.embed_tokens.weight",), "vocab")


def tp_partition_dim(kind: str) -> int | None:
    """Dimension a ``kind`` is split along across TP ranks (None: replicated)."""
    return {"replicated": None, "row": 1, "expert": None, "expert_gate_up": None}.get(kind, 0)


# --------------------------------------------------------------------------- HF -> Megatron


def _qkv_groups(shape: ModelShape, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``[num_kv_heads, (q_per_group + 2) * head_dim, ...]``: each KV group's [q…q k v] rows."""
    import torch

    g, d = shape.num_kv_heads, shape.head_dim
    rest = q.shape[1:]
    q = q.reshape(g, (shape.num_heads // g) * d, *rest)
    return torch.cat([q, k.reshape(g, d, *rest), v.reshape(g, d, *rest)], dim=1)


def to_megatron(
    shape: ModelShape, mapping: ParamMapping, hf_tensors: Sequence[torch.Tensor], tp_rank: int, tp_size: int
) -> torch.Tensor:
    """The ``tp_rank`` shard of ``mapping``'s Megatron parameter, from its (full) HF tensors."""
    import torch

    kind = mapping.kind
    if kind in ("replicated", "expert"):
        return hf_tensors[0].clone()
    if kind == "expert_gate_up":
        return torch.cat(list(hf_tensors)).clone()
    if kind == "vocab":
        full = hf_tensors[0]
        padded = shape.padded_vocab_size(tp_size)
        if padded != full.shape[0]:
            full = torch.cat([full, full.new_zeros(padded - full.shape[0], *full.shape[1:])])
        return full.chunk(tp_size, dim=0)[tp_rank].clone()
    if kind == "row":
        return hf_tensors[0].chunk(tp_size, dim=1)[tp_rank].clone()
    if kind == "qkv":
        groups = _qkv_groups(shape, *hf_tensors)
        mine = groups.chunk(tp_size, dim=0)[tp_rank]
        return mine.reshape(-1, *mine.shape[2:]).clone()
    if kind == "gate_up":
        gate, up = hf_tensors
        return torch.cat([gate.chunk(tp_size, dim=0)[tp_rank], up.chunk(tp_size, dim=0)[tp_rank]]).clone()
    raise ValueError(f"unknown mapping kind {kind!r}")


# --------------------------------------------------------------------------- Megatron -> HF


def to_hf(shape: ModelShape, mapping: ParamMapping, shards: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The full HF tensors of ``mapping`` from the Megatron shards of every TP rank (rank order)."""
    import torch

    kind = mapping.kind
    if kind in ("replicated", "expert"):
        return [shards[0].clone()]
    if kind == "expert_gate_up":
        return [t.clone() for t in shards[0].chunk(2, dim=0)]
    if kind == "vocab":
        return [torch.cat(list(shards), dim=0)[: shape.vocab_size].clone()]
    if kind == "row":
        return [torch.cat(list(shards), dim=1)]
    if kind == "qkv":
        g, d = shape.num_kv_heads, shape.head_dim
        q_rows = (shape.num_heads // g) * d
        full = torch.cat(list(shards), dim=0)
        rest = full.shape[1:]
        groups = full.reshape(g, q_rows + 2 * d, *rest)
        q, k, v = groups.split([q_rows, d, d], dim=1)
        return [t.reshape(-1, *rest).clone() for t in (q, k, v)]
    if kind == "gate_up":
        halves = [s.chunk(2, dim=0) for s in shards]
        return [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]
    raise ValueError(f"unknown mapping kind {kind!r}")


def hf_shape(shape: ModelShape, hf_name: str) -> tuple[int, ...]:
    """The shape of HF tensor ``hf_name`` (for refit metadata, without materialising anything)."""
    h, d = shape.hidden_size, shape.head_dim
    leaf = hf_name.rsplit(".", 2)
    tail = ".".join(leaf[-2:])
    table = {
        "embed_tokens.weight": (shape.vocab_size, h),
        "lm_head.weight": (shape.vocab_size, h),
        "q_proj.weight": (shape.num_heads * d, h),
        "k_proj.weight": (shape.num_kv_heads * d, h),
        "v_proj.weight": (shape.num_kv_heads * d, h),
        "q_proj.bias": (shape.num_heads * d,),
        "k_proj.bias": (shape.num_kv_heads * d,),
        "v_proj.bias": (shape.num_kv_heads * d,),
        "o_proj.weight": (h, shape.num_heads * d),
        "q_norm.weight": (d,),
        "k_norm.weight": (d,),
        "gate_proj.weight": (shape.intermediate_size, h),
        "up_proj.weight": (shape.intermediate_size, h),
        "down_proj.weight": (h, shape.intermediate_size),
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "norm.weight": (h,),
        "score.weight": (1, h),
        "score.bias": (1,),
    }
    if ".mlp.experts." in hf_name:
        f = shape.moe_intermediate_size
        table.update({"gate_proj.weight": (f, h), "up_proj.weight": (f, h), "down_proj.weight": (h, f)})
    table["gate.weight"] = (shape.num_experts, h)
    if tail not in table:
        raise KeyError(f"unknown HF parameter {hf_name!r}")
    return table[tail]


# --------------------------------------------------------------------------- whole state dicts (tests, tools)


def hf_to_megatron_state(
    shape: ModelShape,
    hf_state: Mapping[str, torch.Tensor],
    tp_rank: int,
    tp_size: int,
    mappings: Iterable[ParamMapping] | None = None,
) -> dict[str, torch.Tensor]:
    """``{megatron global name: tp_rank shard}`` for ``mappings`` (default: the whole model)."""
    get: Callable[[str], Any] = hf_state.__getitem__
    if shape.tie_word_embeddings and "lm_head.weight" in hf_state and "model.embed_tokens.weight" not in hf_state:
        get = lambda n: hf_state["lm_head.weight" if n == "model.embed_tokens.weight" else n]  # noqa: E731
    return {
        m.megatron: to_megatron(shape, m, [get(n) for n in m.hf], tp_rank, tp_size)
        for m in (mappings if mappings is not None else all_mappings(shape))
    }


def megatron_to_hf_state(shape: ModelShape, tp_states: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The full HF state dict from every TP rank's ``{megatron global name: shard}`` (rank order)."""
    out: dict[str, Any] = {}
    for m in all_mappings(shape):
        out.update(zip(m.hf, to_hf(shape, m, [s[m.megatron] for s in tp_states])))
    return out


__all__ = [
    "ARCHITECTURES",
    "ModelShape",
    "ParamMapping",
    "all_mappings",
    "expert_mappings",
    "hf_shape",
    "hf_to_megatron_state",
    "layer_mappings",
    "megatron_to_hf_state",
    "output_copy_mapping",
    "to_hf",
    "to_megatron",
    "tp_partition_dim",
    "value_head_mappings",
]
