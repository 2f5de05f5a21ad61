"""Keep megatron-core's optional wandb import out of a worker process.

``megatron.core.timers`` imports wandb for an optional ``Timers`` writer that this backend never passes.
Importing wandb creates two temp directories (``wandb-media``, ``wandb-artifacts``) that it removes only at a
clean interpreter exit; rlcore ends its workers by killing them, so the directories would stay behind. Before
megatron-core is imported, the worker marks wandb as absent in its own process (``sys.modules['wandb'] = None``:
``import wandb`` raises ImportError, which megatron handles, and ``importlib.util.find_spec('wandb')`` is None).
The driver, where rlcore's wandb tracker runs, is not touched.
"""

from __future__ import annotations

import sys


def keep_wandb_out() -> None:
    """Mark wandb as not installed in this process, unless something here imported it already."""
    sys.modules.setdefault("wandb", None)  # type: ignore[arg-type]


def wandb_imported() -> bool:
    """Whether wandb is loaded in this process (tests: a megatron worker never loads it)."""
    return sys.modules.get("wandb") is not None


__all__ = ["keep_wandb_out", "wandb_imported"]
