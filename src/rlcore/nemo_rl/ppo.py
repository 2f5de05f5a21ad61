"""NeMo-RL's PPO configs as rlcore's: a ``ppo`` section, with a critic.

NeMo-RL's PPO (``examples/run_ppo.py``) reads ``ppo``, ``loss_fn`` (the policy's clipped loss, GRPO's),
``value_loss_fn``, ``policy`` (with its ``generation``), ``value`` (the critic's policy section), ``data``, ``env``,
``checkpointing``, ``logger`` and ``cluster``. rlcore's ``ppo`` section takes NeMo-RL's keys with their names and
defaults (:class:`rlcore.algorithms.ppo.config.PPOConfig`, which refuses by path what rlcore does not run), so
``ppo`` maps by the table; ``loss_fn`` converts as a GRPO config's; ``value_loss_fn`` becomes ``value_loss``.

The critic: rlcore's ``ppo.value`` is the critic's settings over the policy's. NeMo-RL's ``value`` is converted
as ``policy`` is and compared with the policy's (:mod:`rlcore.nemo_rl.second_policy`): what differs is the
critic's own (its backend, parallel layout, learning rate, batch sizes). Its ``reward_model_cfg`` (``enabled``,
``regression``) is how NeMo-RL's dtensor critic gets a scalar head (its megatron critic writes ``enabled: false``
and builds one anyway); rlcore always builds the critic with a value head (``model_head="value"``), so that setting
is what it does already.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlcore.nemo_rl.conversion import Conversion, algorithm
from rlcore.nemo_rl.second_policy import own_settings

_MISSING = object()


def value(nemo: dict[str, Any], out: Conversion, convert: Callable[[dict[str, Any]], Conversion]) -> None:
    """``value`` (see the module's docstring); in another algorithm's config it is not read. ``convert``: the
    table's walker (:func:`rlcore.nemo_rl.convert.convert`, passed in: it imports this module)."""
    section, algo = nemo.get("value", _MISSING), algorithm(nemo)
    if section is _MISSING:
        return
    if algo != "ppo":
        out.ignored.append(("value", f"only NeMo-RL's PPO reads it (this is a {algo} config)"))
        return
    if not isinstance(section, dict):
        out.problems.append(f"value: is {section!r}; NeMo-RL's PPO reads the critic's policy section there")
        return
    rest = dict(section)
    head = rest.pop("reward_model_cfg", _MISSING)
    if head is not _MISSING:
        if _builds_a_value_head(head):
            out.ignored.append(
                (
                    "value.reward_model_cfg",
                    "rlcore always builds the critic with a scalar value head (model_head='value')",
                )
            )
        else:
            out.problems.append(
                f"value.reward_model_cfg: is {head!r}; rlcore's critic is a regression value head, as NeMo-RL's "
                "enabled: true, reward_model_type: regression builds it (or enabled: false, which its megatron critic "
                "reads as the same); set those"
            )
    own_settings(rest, out, convert, "ppo.value", "value")


def _builds_a_value_head(head: Any) -> bool:
    """NeMo-RL's ``reward_model_cfg`` of a critic: ``enabled`` with the ``regression`` head is how its dtensor critic
    gets its scalar head; ``enabled: false`` is what its megatron critic's configs write (it builds the head
    regardless)."""
    if not isinstance(head, dict):
        return False
    return head.get("enabled") is False or head.get("reward_model_type", "regression") == "regression"


__all__ = ["value"]
