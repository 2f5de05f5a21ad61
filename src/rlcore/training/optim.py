"""Optimizer, LR scheduler and gradient clipping shared by the training backends.

Configs follow NeMo-RL's shapes and may be the pydantic objects from
``rlcore.config`` or plain dicts with the same keys:

- optimizer: ``{"name": "torch.optim.AdamW" | "AdamW", "kwargs": {...}}``
- scheduler: ``None``, one ``{"name", "kwargs"}`` or a list of them with at
  most one ``{"name": "milestones", "milestones": [...]}`` element (NeMo-RL
  also writes it without ``name``).

torch is imported inside the functions: ``rlcore`` stays importable without it.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Iterable
from typing import Any


def _field(cfg: Any, key: str, default: Any = None) -> Any:
    """``cfg[key]`` for a mapping, ``cfg.key`` for an object (pydantic model)."""
    if isinstance(cfg, dict):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def _resolve_class(name: Any, default_module: str, base: type, what: str) -> type:
    """Import ``name`` (a dotted path, or a short name looked up in ``default_module``).

    Raises ValueError naming ``name`` if it cannot be imported or is not a ``base``.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"{what} name must be a non-empty string, got {name!r}")
    module_name, _, attr = name.rpartition(".")
    try:
        module = importlib.import_module(module_name or default_module)
        cls = getattr(module, attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"unknown {what} {name!r}: {err}") from err
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ValueError(f"{what} {name!r} is not a subclass of {base.__module__}.{base.__qualname__}")
    return cls


def build_optimizer(params: Any, optimizer_cfg: Any, default_lr: float | None = None):
    """Instantiate the optimizer named by ``optimizer_cfg.name`` with ``optimizer_cfg.kwargs``.

    ``lr`` falls back to ``default_lr`` when the kwargs do not set it (and to the
    optimizer's own default when both are absent). Unknown names → ValueError.
    """
    import torch

    cls = _resolve_class(_field(optimizer_cfg, "name"), "torch.optim", torch.optim.Optimizer, "optimizer")
    kwargs = dict(_field(optimizer_cfg, "kwargs") or {})
    if "lr" not in kwargs and default_lr is not None:
        kwargs["lr"] = default_lr
    return cls(params, **kwargs)


def _is_milestones(cfg: Any) -> bool:
    name = _field(cfg, "name")
    return name == "milestones" or (name is None and _field(cfg, "milestones") is not None)


def build_scheduler(optimizer: Any, scheduler_cfg: Any = None):
    """Build the LR scheduler for ``optimizer`` (stepped once per optimizer step).

    - ``None`` (or an empty list) → constant LR (``LambdaLR`` with factor 1).
    - one scheduler config → that scheduler.
    - a list of scheduler configs plus a milestones element → ``SequentialLR``:
      scheduler ``i`` runs from milestone ``i-1`` to milestone ``i``. There must
      be exactly ``len(schedulers) - 1`` milestones, else ValueError. A single
      scheduler in a list needs no milestones and is returned as is.
    """
    from torch.optim.lr_scheduler import LambdaLR, LRScheduler, SequentialLR

    if scheduler_cfg is None:
        return LambdaLR(optimizer, lr_lambda=_constant_one)
    entries = list(scheduler_cfg) if isinstance(scheduler_cfg, (list, tuple)) else [scheduler_cfg]
    milestone_entries = [e for e in entries if _is_milestones(e)]
    if len(milestone_entries) > 1:
        raise ValueError("scheduler config has more than one milestones element")
    milestones = [int(m) for m in (_field(milestone_entries[0], "milestones") or [])] if milestone_entries else []

    # Validate before constructing: each scheduler applies its initial factor to the optimizer.
    specs = [e for e in entries if not _is_milestones(e)]
    classes = [
        _resolve_class(_field(e, "name"), "torch.optim.lr_scheduler", LRScheduler, "LR scheduler") for e in specs
    ]
    if len(milestones) != max(len(specs) - 1, 0):
        raise ValueError(
            f"{len(specs)} scheduler(s) need {max(len(specs) - 1, 0)} milestone(s), got {len(milestones)}: {milestones}"
        )
    if milestones != sorted(milestones):
        raise ValueError(f"milestones must be increasing, got {milestones}")
    if not specs:
        return LambdaLR(optimizer, lr_lambda=_constant_one)

    schedulers = [cls(optimizer, **dict(_field(e, "kwargs") or {})) for cls, e in zip(classes, specs)]
    if len(schedulers) == 1:
        return schedulers[0]
    return SequentialLR(optimizer, schedulers, milestones)


def _constant_one(_step: int) -> float:
    """Module-level (not a lambda) so a scheduler using it can be pickled (e.g. sent to a worker)."""
    return 1.0


def clip_grad_norm_(parameters: Iterable[Any] | Any, max_norm: float | None, norm_type: float = 2.0) -> float:
    """Total gradient norm of ``parameters``; scale gradients down to ``max_norm`` if given.

    ``max_norm=None`` disables clipping: the norm is only computed (for
    logging) and the gradients are left untouched — the one meaning of
    ``max_grad_norm: None`` across backends. The norm is accumulated in
    float32 (float64 for float64 grads) whatever the gradient dtype. When the
    norm is not finite, gradients are not scaled (the caller decides whether to
    skip the step). Gradients are scaled by ``max_norm / (norm + 1e-6)`` when
    that is < 1, as ``torch.nn.utils.clip_grad_norm_`` does.

    Plain (local) tensors only: with sharded gradients (DTensor, FSDP) each rank
    sees only its shard, and the backend must reduce the partial norms across
    ranks itself.
    """
    import torch

    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return 0.0
    norm_type = float(norm_type)

    def acc(g):
        return g.detach().to(torch.float64 if g.dtype == torch.float64 else torch.float32)

    if math.isinf(norm_type):
        total = max(acc(g).abs().max() for g in grads)
    else:
        per_grad = torch.stack([torch.linalg.vector_norm(acc(g), norm_type).double() for g in grads])
        total = torch.linalg.vector_norm(per_grad, norm_type)
    total_norm = float(total)

    if max_norm is not None and math.isfinite(total_norm):
        coef = float(max_norm) / (total_norm + 1e-6)
        if coef < 1.0:
            for g in grads:
                g.detach().mul_(coef)
    return total_norm


__all__ = ["build_optimizer", "build_scheduler", "clip_grad_norm_"]
