"""Moved: joining torch.distributed groups is :mod:`rlcore.training.process_group` (the refit uses it too,
and sits below the Ray runtime). This path re-exports it for one release (rlcore 0.2) and warns."""

import warnings

from rlcore.training.process_group import init_distributed, tcp_store

warnings.warn(
    "rlcore.distributed.process_group moved to rlcore.training.process_group; this alias goes in rlcore 0.3",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["init_distributed", "tcp_store"]
