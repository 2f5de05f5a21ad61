"""Reading and writing the weights of a sharded (FSDP2 / DTensor) model.

- :func:`local_tensor` / :func:`snapshot_local` / :func:`restore_local`: this
  rank's own shards, for the reference model kept on CPU (no communication).
- :func:`iter_full_tensors`: full, HF-named tensors in ``state_dict`` order,
  gathered one at a time (a collective: every rank must iterate).
- :func:`load_full_state_dict`: full tensors (an HF checkpoint) into the shards (collective).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (sharing its storage), or ``t`` itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def reshard(model: nn.Module) -> None:
    """Put every FSDP group back in its sharded state, so shards are the only copy of the weights."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _named_state(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from model.named_parameters()
    yield from model.named_buffers()


def snapshot_local(model: nn.Module) -> dict[str, torch.Tensor]:
    """A CPU copy of this rank's parameter shards and buffers."""
    reshard(model)
    with torch.no_grad():
        return {name: local_tensor(t).detach().to("cpu", copy=True) for name, t in _named_state(model)}


def restore_local(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy a :func:`snapshot_local` back into the shards, in place."""
    reshard(model)
    with torch.no_grad():
        for name, t in _named_state(model):
            local_tensor(t).copy_(state[name], non_blocking=True)


def refit_names(model: nn.Module) -> list[str]:
    """``state_dict`` names with tied duplicates dropped (``lm_head.weight`` when tied to the embedding)."""
    seen: set[int] = set()
    names = []
    for name, t in model.state_dict(keep_vars=True).items():
        key = id(t)
        if key not in seen:
            seen.add(key)
            names.append(name)
    return names


def full_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Global shapes of the refit tensors, in :func:`refit_names` order (no communication)."""
    state = model.state_dict(keep_vars=True)
    return {name: tuple(state[name].shape) for name in refit_names(model)}


def iter_full_tensors(
    model: nn.Module, dtype: torch.dtype | None = None, keep: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, full tensor)`` in :func:`refit_names` order (only names ``keep`` accepts, if given);
    DTensors are all-gathered (collective: every rank must iterate with the same ``keep``)."""
    state = model.state_dict(keep_vars=True)
    for name in refit_names(model):
        if keep is not None and not keep(name):
            continue
        t = state[name].detach()
        full = t.full_tensor() if isinstance(t, DTensor) else t
        yield name, full if dtype is None else full.to(dtype)


def load_full_state_dict(
    model: nn.Module, full: dict[str, torch.Tensor], only: Callable[[str], bool] | None = None
) -> None:
    """Copy full tensors (the same on every rank) into the model's shards; each rank keeps its own part.

    ``full`` must hold every tensor of the model, or every one ``only`` accepts
    (a LoRA adapter checkpoint). Collective: torch's ``set_model_state_dict``
    distributes DTensor shards.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    reshard(model)
    missing = [n for n in refit_names(model) if n not in full and (only is None or only(n))]
    if missing:
        raise KeyError(f"checkpoint lacks {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, strict=False))
