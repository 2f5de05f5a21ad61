"""Tasks of ``rlcore run``: where prompts come from and how completions are scored.

A task is two functions named by import path in the config's ``task``
section (``'module:function'``): ``prompts(step, n, seed, **kwargs) ->
list[str]`` and ``reward(prompts, completions, **kwargs) -> list[float]``.
:mod:`rlcore.run.tasks.toy` is the default one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from rlcore.plugins import import_object


@dataclass
class Task:
    """A task's two functions, imported from the config's ``task`` section, and their extra kwargs."""

    prompts: Callable[..., list[str]]
    reward: Callable[..., list[float]]
    kwargs: dict[str, Any]

    @classmethod
    def from_config(cls, task_cfg: Any) -> "Task":
        return cls(import_object(task_cfg.prompts), import_object(task_cfg.reward), dict(task_cfg.kwargs))
