"""Named sharding: where each rank sits on the (pp, dp, cp, tp) grid.

Ranks are laid out with ``tp`` fastest, then ``cp``, ``dp``, ``pp``
(design.md §2.5). Data is split along ``dp`` and replicated along the others;
results are read from the ranks at coordinate 0 of every replicated axis.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

AXES = ("pp", "dp", "cp", "tp")


@dataclass(frozen=True)
class NamedSharding:
    pp: int = 1
    dp: int = 1
    cp: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for axis in AXES:
            if getattr(self, axis) < 1:
                raise ValueError(f"{axis} size must be >= 1, got {getattr(self, axis)}")

    @classmethod
    def for_world(cls, world_size: int, *, tp: int = 1, cp: int = 1, pp: int = 1) -> NamedSharding:
        """The layout with the given model-parallel sizes; dp takes the rest."""
        model_parallel = tp * cp * pp
        if world_size % model_parallel:
            raise ValueError(
                f"tensor_parallel_size*context_parallel_size*pipeline_parallel_size = {tp}*{cp}*{pp} = "
                f"{model_parallel} does not divide the world size {world_size}"
            )
        return cls(pp=pp, dp=world_size // model_parallel, cp=cp, tp=tp)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, a) for a in AXES)

    @property
    def world_size(self) -> int:
        return prod(self.shape)

    def coords(self, rank: int) -> dict[str, int]:
        """``{"pp": i, "dp": j, "cp": k, "tp": l}`` of a rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of {self.world_size}")
        out = {}
        for axis in reversed(AXES):
            size = getattr(self, axis)
            out[axis] = rank % size
            rank //= size
        return {a: out[a] for a in AXES}

    def rank(self, **coords: int) -> int:
        r = 0
        for axis in AXES:
            r = r * getattr(self, axis) + coords.get(axis, 0)
        return r

    def output_ranks(self) -> list[int]:
        """One rank per dp index, at coordinate 0 of pp, cp and tp, ordered by dp."""
        return [self.rank(dp=d) for d in range(self.dp)]
