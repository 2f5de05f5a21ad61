"""How a training backend tells the core its parallel layout (plugin API 2).

A spec names a layout function as ``layout="my_pkg.layout:parallel_layout"``.
The core calls it once, while it resolves a config and before any process
starts, with a :class:`LayoutRequest`, and shards every batch by what it
returns: data is split over the data-parallel ranks and the ranks of the
other axes get the same data (design.md §2.5). A backend without a layout
function runs pure data parallel.

The function must be light (it runs on the driver, like the config class). For
a layout it cannot run it raises ``ValueError`` with one line per problem,
each naming the dotted config path and the fix (``policy.x_cfg.tp: ...``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from pydantic import BaseModel

#: The model-parallel axes a layout declares, in the order ranks are laid out after dp: (pp, dp, cp, tp).
MODEL_PARALLEL_AXES = ("tp", "cp", "pp")


@dataclass(frozen=True)
class LayoutRequest:
    """What a layout function is given."""

    policy: BaseModel  # the validated rlcore.config.PolicyConfig
    section: BaseModel | None  # the backend's own section, validated with its config_class (None without one)
    world_size: int  # training ranks: cluster.num_nodes * cluster.workers_per_node
    use_gpu: bool  # cluster.use_gpu


@dataclass(frozen=True)
class ParallelLayout:
    """Model-parallel degrees of one policy: tensor (tp), context (cp) and pipeline (pp) parallel.

    Data parallelism is what is left: ``world_size // (tp * cp * pp)`` ranks.
    Axes a backend nests inside data parallelism (expert parallel) do not change
    how data is sharded and are not declared here. ``paths`` names, for each
    axis above 1, the config setting it came from, so that the core's messages
    point at the right key.
    """

    tp: int = 1
    cp: int = 1
    pp: int = 1
    paths: Mapping[str, str] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for axis in MODEL_PARALLEL_AXES:
            size = getattr(self, axis)
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"ParallelLayout.{axis} must be a positive integer, got {size!r}")

    @property
    def model_parallel_size(self) -> int:
        return self.tp * self.cp * self.pp

    def sizes(self) -> dict[str, int]:
        """``{"tp": .., "cp": .., "pp": ..}``."""
        return {axis: getattr(self, axis) for axis in MODEL_PARALLEL_AXES}

    def parallel_axes(self) -> dict[str, int]:
        """The axes above 1: ``{"tp": 2}``."""
        return {axis: size for axis, size in self.sizes().items() if size > 1}

    def describe(self) -> str:
        """``tp 2 × pp 3 = 6`` over the axes above 1 (``data parallel only`` without any)."""
        axes = self.parallel_axes()
        terms = " × ".join(f"{axis} {size}" for axis, size in axes.items())
        return f"{terms} = {self.model_parallel_size}" if len(axes) > 1 else (terms or "data parallel only")

    def setting_paths(self) -> list[str]:
        """The config settings behind the axes above 1, as the backend named them."""
        return [self.paths.get(axis, axis) for axis in self.parallel_axes()]


#: The layout of a backend that declares none: every rank is its own data-parallel rank.
DATA_PARALLEL = ParallelLayout()
