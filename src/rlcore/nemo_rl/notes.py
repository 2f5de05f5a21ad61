"""The ``note:`` lines of a conversion: NeMo-RL settings rlcore accepts but computes differently on purpose.

Each note names the NeMo-RL setting, what rlcore does instead, and where the reason is written
(``docs/nemo-rl-semantics.md``). A setting that behaves the same gets no note.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlcore.nemo_rl.conversion import Conversion, algorithm, get

DOC = "docs/nemo-rl-semantics.md"


def _loss(nemo: dict[str, Any], key: str) -> Any:
    return get(nemo, f"loss_fn.{key}")


def _vapo(nemo: dict[str, Any]) -> str | None:
    weight = _loss(nemo, "positive_example_nll_weight")
    if isinstance(weight, (int, float)) and not isinstance(weight, bool) and weight > 0:
        return (
            "loss_fn.positive_example_nll_weight: rlcore divides the NLL by the step's count of rewarded tokens, "
            "NeMo-RL by the micro-batch's, so the two agree only for one micro-batch on one rank"
        )
    return None


def _forced_reinforce(nemo: dict[str, Any]) -> str | None:
    if _loss(nemo, "force_on_policy_ratio") is True and _loss(nemo, "disable_ppo_ratio") is True:
        return (
            "loss_fn.force_on_policy_ratio with disable_ppo_ratio: rlcore's loss value stays -A log pi where "
            "NeMo-RL's is -A; the gradients are the same"
        )
    return None


def _forced_gspo(nemo: dict[str, Any]) -> str | None:
    if _loss(nemo, "force_on_policy_ratio") is True and _loss(nemo, "sequence_level_importance_ratios") is True:
        return (
            "loss_fn.force_on_policy_ratio with sequence_level_importance_ratios: rlcore keeps GSPO's sequence "
            "ratio, whose gradient equals NeMo-RL's per-token one only where the advantage is constant per "
            "sequence (as in GRPO)"
        )
    return None


def _gspo_token_level(nemo: dict[str, Any]) -> str | None:
    if _loss(nemo, "sequence_level_importance_ratios") is True and _loss(nemo, "token_level_loss") is not False:
        return (
            "loss_fn.sequence_level_importance_ratios with token_level_loss: NeMo-RL refuses the pair, rlcore "
            "trains GSPO's sequence ratio with a per-token mean"
        )
    return None


#: Every check, in the order the notes are listed.
CHECKS: tuple[Callable[[dict[str, Any]], str | None], ...] = (_vapo, _forced_reinforce, _forced_gspo, _gspo_token_level)


def add_notes(nemo: dict[str, Any], out: Conversion) -> None:
    """Append to ``out.notes`` one line per deliberate difference the GRPO config ``nemo`` meets."""
    if algorithm(nemo) != "grpo" or not isinstance(nemo.get("loss_fn"), dict):
        return
    for check in CHECKS:
        if (line := check(nemo)) is not None:
            out.notes.append(f"{line} ({DOC})")
