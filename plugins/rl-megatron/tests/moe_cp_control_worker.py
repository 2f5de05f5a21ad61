"""The megatron worker for the negative control of test_megatron_moe.py's context-parallel run: the routers' logits
are not gathered over the context-parallel group, so each CP rank's aux loss sees only its own positions (what the
backend did before it gathered them). Test code only; imported inside the Ray worker processes."""

from __future__ import annotations

from typing import Any

import torch

from rl_megatron import context_parallel
from rl_megatron.worker import MegatronPolicyWorker


def _own_positions_only(logits: torch.Tensor, group: Any) -> torch.Tensor:
    return logits


class UngatheredRouterLogitsWorker(MegatronPolicyWorker):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        context_parallel.gather_router_logits = _own_positions_only
        super().__init__(*args, **kwargs)
