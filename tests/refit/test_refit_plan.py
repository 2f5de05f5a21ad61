"""A training backend without a refit plan is refused in one line before anything reaches an engine."""

from __future__ import annotations

import pytest

from rlcore.refit import RefitError
from rlcore.refit.synchronizer import WeightSynchronizer


class _PlanlessPolicy:
    def prepare_refit_info(self, changed_only: bool = False) -> None:
        return None


class _Engines:
    def __init__(self) -> None:
        self.plans: list[object] = []

    def prepare_refit_info(self, state_dict_info: object, partial: bool = False) -> None:
        self.plans.append(state_dict_info)


@pytest.mark.parametrize("transport", ["shared_memory", "collective"])
def test_a_policy_without_a_plan_is_refused_before_the_engines_see_it(transport):
    engines = _Engines()
    sync = WeightSynchronizer(_PlanlessPolicy(), engines, colocated=True, transport=transport, cluster=object())
    with pytest.raises(RefitError, match=r"prepare_refit_info\(\) gave no plan") as caught:
        sync.sync_weights()
    assert len(str(caught.value).splitlines()) == 1
    assert engines.plans == []  # the engines were never handed None
    assert sync.stale  # the weights were not refit
