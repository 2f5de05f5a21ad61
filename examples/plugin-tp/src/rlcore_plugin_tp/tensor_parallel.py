"""Tensor parallelism by hand: the linear layers of a Llama-style decoder split over a process group.

Each attention and MLP block becomes column-parallel layers (q/k/v, gate/up:
each rank computes its slice of the output features, i.e. its heads or its
slice of the MLP) followed by a row-parallel one (o, down: each rank multiplies
its slice of the input features, and the partial outputs are summed over the
group). Two autograd functions carry the communication: the input of a
column-parallel layer is summed over the group in backward, the output of a
row-parallel layer in forward. With fewer key/value heads than ranks (grouped
query attention), each rank keeps the key/value head its query heads read, and
the ranks sharing a head sum that head's gradients. Everything else
(embeddings, norms, the LM head) is replicated, and its gradients come out
equal on every rank of the group.

Parameter names stay Hugging Face's, holding this rank's :class:`Slice`, which
says how to gather them back (checkpoints) and cut full tensors (loading).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")
KEY_VALUE = ("k_proj", "v_proj")


@dataclass(frozen=True)
class Slice:
    """Which part of a full tensor this rank holds."""

    dim: int  # the dimension the full tensor is cut along
    pieces: int  # how many distinct slices there are
    index: int  # the one this rank holds
    holders: int = 1  # how many tp ranks hold each slice (> 1: shared key/value heads)

    def of(self, full: torch.Tensor) -> torch.Tensor:
        return full.chunk(self.pieces, dim=self.dim)[self.index].clone()

    def gather(self, local: torch.Tensor, group: Any, size: int) -> torch.Tensor:
        """The full tensor from the slices of the ``size`` ranks of ``group``. Collective."""
        if size == 1:
            return local
        parts = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts[:: self.holders], dim=self.dim)


class _SumGradOverGroup(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the group (the input of a column-parallel layer)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _SumOverGroup(torch.autograd.Function):
    """Forward sums the partial outputs over the group; identity backward (a row-parallel layer's output)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class ColumnParallelLinear(nn.Module):
    """This rank's slice of a linear layer's output features."""

    def __init__(self, linear: nn.Linear, group: Any, part: Slice) -> None:
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(part.of(linear.weight.detach()))
        self.bias = nn.Parameter(part.of(linear.bias.detach())) if linear.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(_SumGradOverGroup.apply(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """This rank's slice of a linear layer's input features; outputs summed over the group."""

    def __init__(self, linear: nn.Linear, group: Any, part: Slice) -> None:
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(part.of(linear.weight.detach()))
        self.bias = nn.Parameter(linear.bias.detach().clone()) if linear.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _SumOverGroup.apply(F.linear(x, self.weight), self.group)
        return out + self.bias if self.bias is not None else out


def head_counts(hf_config: Any, size: int) -> tuple[int, int]:
    """(attention heads, key/value heads) of the model, checked against a tensor-parallel degree ``size``:
    the query heads must split evenly, the key/value heads split evenly or be shared evenly."""
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    if heads % size or (kv_heads % size and size % kv_heads):
        raise ValueError(
            f"policy.tpexample_cfg.tensor_parallel_size: {size} does not divide the model's "
            f"{heads} attention heads, or neither divides nor is divided by its {kv_heads} key/value "
            "heads; choose another degree"
        )
    return heads, kv_heads


def key_value_holders(hf_config: Any, size: int) -> int:
    """How many tp ranks hold each key/value head: 1 when they split, ``size // kv_heads`` when shared."""
    _, kv_heads = head_counts(hf_config, size)
    return 1 if kv_heads % size == 0 else size // kv_heads


def shard_decoder(model: nn.Module, group: Any, rank: int, size: int) -> dict[str, Slice]:
    """Replace the decoder's linear layers by this rank's tensor-parallel slices, in place.

    Returns ``{parameter name: its Slice}`` for every split parameter.
    """
    heads, kv_heads = head_counts(model.config, size)
    holders = key_value_holders(model.config, size)
    column, row = Slice(0, size, rank), Slice(1, size, rank)
    shared = Slice(0, size // holders, rank // holders, holders)  # key/value heads, shared or not
    parts: dict[str, Slice] = {}
    for owner_name, owner in list(model.named_modules()):
        if holders > 1 and hasattr(owner, "num_key_value_groups"):
            owner.num_key_value_groups = heads // size  # this rank's query heads read one key/value head
        for name, child in list(owner.named_children()):
            if not isinstance(child, nn.Linear) or name not in COLUMN + ROW:
                continue
            path = f"{owner_name}.{name}" if owner_name else name
            part = row if name in ROW else (shared if name in KEY_VALUE else column)
            layer = RowParallelLinear if name in ROW else ColumnParallelLinear
            setattr(owner, name, layer(child, group, part))
            parts[f"{path}.weight"] = part
            if child.bias is not None and name not in ROW:
                parts[f"{path}.bias"] = part
    return parts


def process_groups(tp: int, holders: int) -> tuple[Any, Any, Any]:
    """This rank's tensor-parallel group, data-parallel group, and the group of tp ranks holding the same
    key/value heads (None when no head is shared).

    rlcore lays ranks out (pp, dp, cp, tp) with tp fastest, so the tp ranks of
    one data-parallel index are consecutive. Every rank creates every group
    (``new_group`` is collective), in the same order.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    tp_groups = [dist.new_group(list(range(d * tp, (d + 1) * tp))) for d in range(world // tp)]
    dp_groups = [dist.new_group(list(range(t, world, tp))) for t in range(tp)]
    share_groups = (
        [dist.new_group(list(range(s * holders, (s + 1) * holders))) for s in range(world // holders)]
        if holders > 1
        else [None]
    )
    return tp_groups[rank // tp], dp_groups[rank % tp], share_groups[rank // holders if holders > 1 else 0]
