"""The megatron worker with one method added for the negative control of test_megatron_context_parallel.py:
``stop_summing_key_value_gradients`` makes attention's all-gather of keys and values over the context-parallel
group pass back only this rank's own queries' share of their gradient, not the sum over the group. Until it is
called the worker is the production one. Test code only; imported inside the Ray worker processes."""

from __future__ import annotations

from typing import Any

import torch

from rl_megatron import context_parallel
from rl_megatron.worker import MegatronPolicyWorker


def _gather_without_summed_gradients(t: torch.Tensor, group: Any) -> torch.Tensor:
    return context_parallel._GatherSequence.apply(t, 0, group, False)


class KeyValueGradientSwitchWorker(MegatronPolicyWorker):
    def stop_summing_key_value_gradients(self) -> None:
        context_parallel.gather_keys_values = _gather_without_summed_gradients
