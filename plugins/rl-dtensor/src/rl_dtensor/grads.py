"""Global gradient norm and clipping for a model whose gradients are DTensors on different meshes.

After FSDP2 + TP a gradient may live on the 2-D (dp, tp) mesh (TP-sharded
weights), on the 1-D dp mesh (weights TP leaves alone) or nowhere at all. One
rule covers all of them: each rank adds ``||local shard||²`` divided by the
number of ranks that hold an identical copy of that shard (the sizes of the
mesh axes on which the DTensor is replicated, times the world ranks outside
its mesh); a single all-reduce over the world then counts every element
exactly once.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate


def replica_count(placements, mesh_shape, world: int) -> int:
    """How many ranks hold the same local values: ``world`` for a plain tensor, else the sizes of the
    mesh axes a DTensor is replicated on, times the ranks outside its mesh."""
    if placements is None:
        return world
    size = 1
    for n in mesh_shape:
        size *= n
    copies = world // size
    for placement, n in zip(placements, mesh_shape):
        if placement.is_replicate():  # Shard and FSDP's _StridedShard hold distinct pieces
            copies *= n
    return copies


def _copies(t: torch.Tensor, world: int) -> int:
    if not isinstance(t, DTensor):
        return replica_count(None, None, world)
    return replica_count(t.placements, tuple(t.device_mesh.shape), world)


def _settled(g: torch.Tensor) -> torch.Tensor:
    """A gradient whose local values are final: pending (Partial) reductions are carried out first."""
    if isinstance(g, DTensor) and any(p.is_partial() for p in g.placements):
        g = g.redistribute(placements=[Replicate() if p.is_partial() else p for p in g.placements])
    return g


def total_grad_norm(parameters: Iterable[torch.Tensor], device: torch.device) -> float:
    """The 2-norm of all gradients of the (sharded) model, the same on every rank. Collective."""
    world = dist.get_world_size()
    total = torch.zeros((), dtype=torch.float64, device=device)
    for p in parameters:
        if p.grad is None:
            continue
        g = _settled(p.grad)
        local = g.to_local() if isinstance(g, DTensor) else g
        total += local.detach().double().square().sum().to(device) / _copies(g, world)
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return math.sqrt(float(total))


def clip_grads(parameters: Iterable[torch.Tensor], max_norm: float | None, device: torch.device) -> float:
    """Total norm; scale gradients to ``max_norm`` when given (``None``: never clip).

    Same rule as ``rlcore.training.optim.clip_grad_norm_``: coefficient
    ``max_norm / (norm + 1e-6)`` when below 1, no scaling for a non-finite norm.
    """
    params = [p for p in parameters if p.grad is not None]
    norm = total_grad_norm(params, device)
    if max_norm is not None and math.isfinite(norm):
        coef = float(max_norm) / (norm + 1e-6)
        if coef < 1.0:
            for p in params:
                g = p.grad
                (g.to_local() if isinstance(g, DTensor) else g).detach().mul_(coef)
    return norm
