"""Measure several sides of a benchmark in turns, so that a shared machine's drift falls on each alike."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

T = TypeVar("T")


def interleaved(sides: Iterable[str], measure: Callable[[str], T], repeats: int) -> dict[str, list[T]]:
    """``measure(side)`` once per side as a warm-up (discarded), then ``repeats`` rounds measuring every
    side in turn; each side's results in order."""
    sides = list(sides)
    for side in sides:
        measure(side)
    results: dict[str, list[T]] = {side: [] for side in sides}
    for _ in range(repeats):
        for side in sides:
            results[side].append(measure(side))
    return results
