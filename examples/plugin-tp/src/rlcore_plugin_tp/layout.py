"""The 'tpexample' backend's parallel layout, which rlcore shards every batch by.

rlcore calls :func:`parallel_layout` once, when it resolves a config and
before any process starts: the tensor-parallel degree comes from this
backend's own section, and rlcore gives the ``world_size // tp`` data-parallel
ranks their own data and the tp ranks of each the same. Light: no torch.
"""

from rlcore.plugins import LayoutRequest, ParallelLayout


def parallel_layout(request: LayoutRequest) -> ParallelLayout:
    tp = request.section.tensor_parallel_size
    return ParallelLayout(tp=tp, paths={"tp": "policy.tpexample_cfg.tensor_parallel_size"})
