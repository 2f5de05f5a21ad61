"""One rule of the NeMo-RL → rlcore mapping (:mod:`rlcore.nemo_rl.table` holds them all), and what it says.

Actions:

- ``map``: the value goes to ``target`` (a dotted rlcore path), unchanged
  unless ``transform`` names a conversion;
- ``custom``: a converter function (``handler``) reads this key together with
  others (cluster sizes, schedulers, advantages, ...); ``target`` says where
  the result lands;
- ``ignore``: rlcore has no use for it whatever its value (logging, ports,
  kernel and memory choices that do not change what is computed); reported;
- ``neutral``: ignored (and reported) while its value is one of ``neutral``,
  the values that change nothing; any other value is an error, because it
  would change training or generation and rlcore does not implement it;
- ``gate``: the switch of a feature rlcore lacks: off (a ``neutral`` value)
  ignores the whole section (``covers``, default: the switch's parent), on is
  an error;
- ``section``: a section used only when ``active_if`` holds (e.g. ``vllm_cfg``
  when the generation backend is vLLM); otherwise the whole section is
  ignored, except the keys in ``keep``.

Patterns: dotted paths; ``*`` matches any one key. A rule on a mapping
covers its whole subtree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

NONE_OR_EMPTY: tuple[Any, ...] = (None, {}, [])


@dataclass(frozen=True)
class Rule:
    nemo: str
    action: str
    target: str | None = None
    note: str = ""
    neutral: tuple[Any, ...] = ()
    transform: str | None = None
    handler: str | None = None
    covers: tuple[str, ...] | None = None
    active_if: tuple[str, tuple[Any, ...]] | None = None
    keep: tuple[str, ...] = ()


def _m(nemo: str, target: str | None = None, note: str = "", transform: str | None = None) -> Rule:
    return Rule(nemo, "map", target or nemo, note, transform=transform)


def _c(nemo: str, handler: str, target: str, note: str) -> Rule:
    return Rule(nemo, "custom", target, note, handler=handler)


def _i(nemo: str, note: str) -> Rule:
    return Rule(nemo, "ignore", None, note)


def _n(nemo: str, neutral: tuple[Any, ...], note: str) -> Rule:
    return Rule(nemo, "neutral", None, note, neutral=neutral)


def _g(nemo: str, note: str, neutral: tuple[Any, ...] = (False, None), covers: tuple[str, ...] | None = None) -> Rule:
    return Rule(nemo, "gate", None, note, neutral=neutral, covers=covers)


P, G, MG, DT = "policy.", "policy.generation.", "policy.megatron_cfg.", "policy.dtensor_cfg."
MOE = "a MoE setting rlcore's backends do not read: kernels, schedules and inference-side dispatch of the same model"
KERNEL = "kernel/fusion choice: the same computation, another implementation"
MEMORY = "memory placement only: what is computed does not change"
LOGGING = "rlcore logs to <logger.output_dir>/metrics.jsonl, TensorBoard, wandb and MLflow only"


__all__ = ["DT", "G", "KERNEL", "LOGGING", "MEMORY", "MG", "MOE", "NONE_OR_EMPTY", "P", "Rule"]
