"""Moving weights between one rank's Megatron shards and full Hugging Face tensors.

- :func:`load_hf_into_stage`: read, from the HF safetensors files, only the
  tensors this rank's pipeline stage needs and copy its TP shard of each into
  the model.
- :class:`HFExporter`: every rank iterates the whole model in one fixed HF
  order; for each parameter the owning pipeline stage all-gathers its TP
  shards and converts them to full HF tensors, which are then broadcast to the
  other stages. Collective: all ranks must iterate together. Used for refit,
  the HF checkpoint export and tests.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rl_megatron.converter import (
    ModelShape,
    ParamMapping,
    all_mappings,
    hf_shape,
    output_copy_mapping,
    to_hf,
    to_megatron,
    tp_partition_dim,
)

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")


def to_global_name(local_name: str, offset: int, expert_offset: int = 0) -> str:
    """``decoder.layers.<local i>.x`` → ``decoder.layers.<offset + i>.x``, and an expert-parallel rank's
    ``local_experts.<j>`` → ``local_experts.<expert_offset + j>`` (other names unchanged)."""
    name = _LAYER.sub(lambda m: f"decoder.layers.{int(m.group(1)) + offset}.", local_name)
    return _EXPERT.sub(lambda m: f".mlp.experts.local_experts.{int(m.group(1)) + expert_offset}.", name)


def stage_parameters(model: torch.nn.Module, offset: int, expert_offset: int = 0) -> dict[str, torch.nn.Parameter]:
    """``{global megatron name: parameter}`` of one pipeline stage (unwrapped GPTModel); ``expert_offset``: the
    global index of this expert-parallel rank's first expert."""
    return {to_global_name(name, offset, expert_offset): p for name, p in model.named_parameters()}


def stage_mappings(shape: ModelShape, names: Any) -> dict[str, ParamMapping]:
    """The mapping of each global parameter name a stage holds (incl. a tied output-layer copy)."""
    table = {m.megatron: m for m in all_mappings(shape)}
    if shape.tie_word_embeddings:
        table.setdefault("output_layer.weight", output_copy_mapping())
    missing = [n for n in names if n not in table]
    if missing:
        raise KeyError(f"no HF mapping for Megatron parameters {missing}")
    return {n: table[n] for n in names}


def _hf_files(path: str) -> dict[str, str]:
    """``{tensor name: file}`` of an HF safetensors checkpoint directory."""
    directory = Path(path)
    index = directory / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: str(directory / file) for name, file in weight_map.items()}
    single = directory / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {directory}")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return {name: str(single) for name in f.keys()}


def hf_tensor_names(path: str) -> set[str]:
    """The names of the tensors an HF safetensors checkpoint directory holds (reads the index or the header)."""
    return set(_hf_files(path))


def read_hf_tensors(path: str, names: list[str], tie_word_embeddings: bool) -> dict[str, torch.Tensor]:
    """The named tensors from an HF checkpoint, opening each file once (tied lm_head/embed aliasing handled)."""
    from safetensors import safe_open

    files = _hf_files(path)
    alias = {}
    if tie_word_embeddings:  # save_pretrained keeps one of the two tied names
        for a, b in (("model.embed_tokens.weight", "lm_head.weight"), ("lm_head.weight", "model.embed_tokens.weight")):
            if a not in files and b in files:
                alias[a] = b
    wanted: dict[str, list[str]] = {}
    for name in names:
        stored = alias.get(name, name)
        if stored not in files:
            raise KeyError(f"{path}: the checkpoint has no tensor {stored!r}")
        wanted.setdefault(files[stored], []).append(name)
    out = {}
    for file, file_names in wanted.items():
        with safe_open(file, framework="pt") as f:
            for name in file_names:
                out[name] = f.get_tensor(alias.get(name, name))
    return out


@torch.no_grad()
def load_hf_into_stage(
    model: torch.nn.Module,
    shape: ModelShape,
    path: str,
    offset: int,
    tp_rank: int,
    tp_size: int,
    expert_offset: int = 0,
    skip: frozenset[str] = frozenset(),
) -> None:
    """Copy this rank's shards of the HF checkpoint at ``path`` into ``model`` (one pipeline stage; with expert
    parallelism, only this rank's experts are read). Parameters named in ``skip`` (global megatron names) are
    left as they are: a value model's head when the checkpoint is a causal LM's."""
    params = {n: p for n, p in stage_parameters(model, offset, expert_offset).items() if n not in skip}
    mappings = stage_mappings(shape, params)
    needed = sorted({n for m in mappings.values() for n in m.hf})
    hf = read_hf_tensors(path, needed, shape.tie_word_embeddings)
    for name, param in params.items():
        mapping = mappings[name]
        shard = to_megatron(shape, mapping, [hf[n] for n in mapping.hf], tp_rank, tp_size)
        if shard.shape != param.shape:
            raise ValueError(
                f"{name}: converted shard has shape {tuple(shard.shape)}, the model expects {tuple(param.shape)}"
            )
        param.copy_(shard)


@dataclass(frozen=True)
class ExpertGroup:
    """This rank's expert-parallel group: its rank in it, the global ranks of the group, experts per rank."""

    rank: int = 0
    ranks: tuple[int, ...] = (0,)
    group: Any = None
    experts_per_rank: int = 0

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def offset(self) -> int:
        """Global index of this rank's first expert."""
        return self.rank * self.experts_per_rank


class HFExporter:
    """Full HF tensors from a TP × PP × EP sharded model, in one deterministic order (collective).

    An expert's weights live on one rank of each expert-parallel group (expert ``e`` on ep rank
    ``e // experts_per_rank``), which broadcasts them to the others."""

    def __init__(
        self,
        shape: ModelShape,
        model: torch.nn.Module,
        stage_offsets: list[int],
        pp_rank: int,
        tp_group: Any,
        tp_size: int,
        pp_group: Any,
        pp_ranks: list[int],
        experts: ExpertGroup | None = None,
    ) -> None:
        """``stage_offsets[s]`` is the first global layer of stage ``s`` (plus a final ``num_layers`` entry);
        ``pp_ranks[s]`` the global rank of stage ``s`` in this rank's pipeline group."""
        self.shape = shape
        self.experts = experts or ExpertGroup()
        self.params = stage_parameters(model, stage_offsets[pp_rank], self.experts.offset)
        self.stage_offsets = stage_offsets
        self.pp_rank = pp_rank
        self.tp_group, self.tp_size = tp_group, tp_size
        self.pp_group, self.pp_ranks = pp_group, pp_ranks
        # The compute dtype: with bf16 on a GPU, megatron keeps some parameters (the norms) in float32,
        # and the engine receives every tensor in one dtype.
        self.dtype = next(iter(self.params.values())).dtype
        self.mappings = all_mappings(shape)

    def owner_stage(self, mapping: ParamMapping) -> int:
        if mapping.layer is not None:
            return max(s for s in range(len(self.pp_ranks)) if self.stage_offsets[s] <= mapping.layer)
        return 0 if mapping.megatron.startswith("embedding.") else len(self.pp_ranks) - 1

    def refit_info(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """``{hf_name: (shape, dtype name)}`` in iteration order (no communication); dtype names are
        ``str(torch.dtype)`` without the ``torch.`` prefix, as ``rlcore.refit`` compares them."""
        dtype = str(self.dtype).removeprefix("torch.")
        return {name: (hf_shape(self.shape, name), dtype) for m in self.mappings for name in m.hf}

    def _gather_tp(self, param: torch.Tensor, mapping: ParamMapping) -> list[torch.Tensor]:
        local = param.detach()
        if self.tp_size == 1 or tp_partition_dim(mapping.kind) is None:
            return [local]
        shards = [torch.empty_like(local) for _ in range(self.tp_size)]
        dist.all_gather(shards, local.contiguous(), group=self.tp_group)
        return shards

    def _expert_owner(self, mapping: ParamMapping) -> int | None:
        """The ep rank holding ``mapping``'s expert (None: not an expert weight, or no expert parallelism)."""
        if mapping.expert is None or self.experts.size == 1:
            return None
        return mapping.expert // self.experts.experts_per_rank

    @torch.no_grad()
    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        device = next(iter(self.params.values())).device
        for mapping in self.mappings:
            owner = self.owner_stage(mapping)
            expert_owner = self._expert_owner(mapping)
            if owner == self.pp_rank and expert_owner in (None, self.experts.rank):
                tensors = [
                    t.to(self.dtype)
                    for t in to_hf(self.shape, mapping, self._gather_tp(self.params[mapping.megatron], mapping))
                ]
            else:
                tensors = [torch.empty(hf_shape(self.shape, n), dtype=self.dtype, device=device) for n in mapping.hf]
            if expert_owner is not None and owner == self.pp_rank:
                for t in tensors:
                    dist.broadcast(t, src=self.experts.ranks[expert_owner], group=self.experts.group)
            if len(self.pp_ranks) > 1:
                for t in tensors:
                    dist.broadcast(t, src=self.pp_ranks[owner], group=self.pp_group)
            yield from zip(mapping.hf, tensors)


def stage_layer_offsets(config: Any, pp_size: int) -> list[int]:
    """First global layer of each pipeline stage, then ``num_layers``."""
    from rl_megatron.model import layer_offset

    return [layer_offset(config, s) for s in range(pp_size)] + [config.num_layers]


__all__ = [
    "ExpertGroup",
    "HFExporter",
    "hf_tensor_names",
    "load_hf_into_stage",
    "read_hf_tensors",
    "stage_layer_offsets",
    "stage_mappings",
    "stage_parameters",
    "to_global_name",
]
