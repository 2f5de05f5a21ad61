"""The NeMo-RL → rlcore mapping, as data: one :class:`Rule` per NeMo-RL key (or section).

The converter (:mod:`rlcore.nemo_rl.convert`) acts on these rules and
``docs/nemo-rl-mapping.md`` is generated from them (``rlcore config
nemo-rl-table``), so the documentation cannot drift from the behaviour.

What each rule's action does is said in :mod:`rlcore.nemo_rl.rule`. The rules live in two modules by
section: :mod:`~rlcore.nemo_rl.table_policy` (``cluster``, ``policy``) and :mod:`~rlcore.nemo_rl.table_algorithms`
(the algorithm sections and the rest).
"""

from __future__ import annotations

from typing import Any

from rlcore.nemo_rl.rule import Rule
from rlcore.nemo_rl.table_algorithms import ALGORITHM_AND_RUN_RULES
from rlcore.nemo_rl.table_policy import CLUSTER_AND_POLICY_RULES

#: Every rule, in the order the converter tries them (the first whose pattern matches a key wins).
RULES: tuple[Rule, ...] = (*CLUSTER_AND_POLICY_RULES, *ALGORITHM_AND_RUN_RULES)

#: Values that change nothing, for keys the table does not know (newer NeMo-RL releases).
UNKNOWN_NEUTRAL: tuple[Any, ...] = (None, False, 0, 0.0, "", "none", "None", {}, [])

__all__ = ["RULES", "Rule", "UNKNOWN_NEUTRAL"]
