"""What the core offers a plugin's constructors, and the rule by which it passes them: pluggy's.

A constructor gets only the keyword arguments its signature declares (every one
when it takes ``**kwargs``). So a worker written before an argument existed is
served unchanged, and one written after simply declares it: no version table.
An argument whose meaning changes gets a new name; an old name never changes
meaning.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import TypeVar

Value = TypeVar("Value")

#: Keyword arguments of ``Worker(config, tokenizer, **...)`` for a training backend's worker, with the rlcore
#: release that first offered each.
TRAINING_WORKER_KEYWORDS: dict[str, str] = {
    "weights_path": "0.1.0",
    "optimizer_path": "0.1.0",
    "init_optimizer": "0.1.0",
    "init_reference_model": "0.1.0",
    "backend_config": "0.2",
    "layout": "0.2",
    "model_head": "0.3",  # "lm" (a causal LM) or "value" (a value model; capability value_head)
}

#: Keyword arguments of ``Driver(cluster, generation_config, **...)`` for a generation backend's driver class
#: (``lora_rank`` only for adapter refit), with the rlcore release that first offered each.
GENERATION_DRIVER_KEYWORDS: dict[str, str] = {
    "tokenizer": "0.1.0",
    "backend_config": "0.2",
    "lora_rank": "0.2",
}


def declared_kwargs(  # type: ignore[explicit-any]  # fn: any signature at all, which is the point
    fn: Callable[..., object], available: Mapping[str, Value]
) -> dict[str, Value]:
    """The entries of ``available`` that ``fn`` (a function or a class) declares as keyword parameters; all of
    them when it takes ``**kwargs``, none when its signature cannot be read."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return {}
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return dict(available)
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return {key: value for key, value in available.items() if key in names}
