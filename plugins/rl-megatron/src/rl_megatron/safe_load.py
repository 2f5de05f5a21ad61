"""``megatron.core.dist_checkpointing.load`` with every file read made safe for untrusted checkpoints.

A checkpoint directory is untrusted input (design.md §2.8). What megatron-core
0.16.1 reads when it loads a ``torch_dist`` checkpoint, and how it is read here:

- ``metadata.json`` (which load strategies to use): ``json``. The strategies
  are passed explicitly, so the file cannot pick another loader; they accept
  only the ``torch_dist`` / ``torch`` backends.
- ``common.pt`` (non-sharded state: optimizer ``param_groups``, scheduler):
  megatron calls ``torch.load`` leaving ``weights_only`` to torch's default
  (which an environment variable turns off) → :class:`SafeCommonLoadStrategy`,
  ``weights_only=True``.
- ``<key>/shard_*.pt`` (sharded objects, for strategies that cannot store
  them; ``torch_dist`` can): same as ``common.pt``.
- ``.metadata`` (the DCP index): torch's ``FileSystemReader`` reads it with
  plain ``pickle.load`` → :class:`SafeMetadataReader`, an exact allow-list.
- ``*.distcp`` tensors: torch reads them with ``weights_only=True``; kept.
- ``*.distcp`` objects (``ShardedObject`` s, e.g. every layer's
  ``_extra_state``): DCP's default planner calls ``torch.load(weights_only=False)``
  → :class:`SafeLoadPlanner`, ``weights_only=True``.

Every ``weights_only`` load in the call sees torch's own allow-list only:
megatron-core widens it process-wide at import (numpy arrays, ``argparse.Namespace``,
its config dataclasses...), and none of that is in an rl-megatron checkpoint.

The reader and the planner are created inside megatron's
``TorchDistLoadShardedStrategy`` methods, so :class:`SafeTorchDistLoadStrategy`
swaps them into megatron's module for the duration of its calls (and fails
if they are not where 0.16.1 has them).

Imports megatron-core: import it only where megatron is in use.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
from collections.abc import Iterator
from typing import Any

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import mapping
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
from megatron.core.dist_checkpointing.strategies import torch as torch_strategy
from megatron.core.dist_checkpointing.strategies.cached_metadata_filesystem_reader import (
    CachedMetadataFileSystemReader,
)
from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME, TorchCommonLoadStrategy
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.planner import ReadItem

from rlcore.safe_pickle import exact_torch_safe_globals, read_dcp_metadata, torch_load
from rlcore.training.sharded_checkpoint import dcp_errors_in_words

#: The only backends rl-megatron writes (``metadata.json``).
SHARDED_BACKEND, COMMON_BACKEND = "torch_dist", "torch"


class SafeMetadataReader(CachedMetadataFileSystemReader):
    """megatron's caching DCP reader, reading ``.metadata`` with an exact allow-list."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        if self._cached_metadata is None:
            self._cached_metadata = read_dcp_metadata(self, kwargs.get("rank"))
        return self._cached_metadata


class SafeLoadPlanner(torch_strategy.MCoreLoadPlanner):
    """megatron's load planner, unpickling sharded objects with ``weights_only=True``."""

    def __init__(self, *args: Any, source: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.source = source

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        obj = torch_load(value, f"{self.source} (object {fqn!r})")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


class SafeTorchDistLoadStrategy(torch_strategy.TorchDistLoadShardedStrategy):
    """megatron's ``torch_dist`` loader, building :class:`SafeMetadataReader` s and :class:`SafeLoadPlanner` s."""

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        if loaded_backend != SHARDED_BACKEND:
            raise ValueError(
                f"sharded backend {loaded_backend!r}: rl-megatron reads only {SHARDED_BACKEND!r} checkpoints"
            )

    def load(self, sharded_state_dict: Any, checkpoint_dir: Any) -> Any:
        with exact_torch_safe_globals(), _safe_reader_and_planner(checkpoint_dir), dcp_errors_in_words(checkpoint_dir):
            SafeMetadataReader(checkpoint_dir).read_metadata()  # a refused index raises whole, not inside DCP's text
            return super().load(sharded_state_dict, checkpoint_dir)

    def load_tensors_metadata(self, checkpoint_dir: Any, metadata: Any = None) -> Any:
        if metadata is None:
            metadata = SafeMetadataReader(checkpoint_dir).read_metadata()
        return super().load_tensors_metadata(checkpoint_dir, metadata)

    def load_sharded_metadata(self, checkpoint_dir: Any) -> Any:
        with _safe_reader_and_planner(checkpoint_dir):
            return super().load_sharded_metadata(checkpoint_dir)


class SafeCommonLoadStrategy(TorchCommonLoadStrategy):
    """megatron's common-state loader with ``weights_only=True`` and torch's own allow-list."""

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        if loaded_backend != COMMON_BACKEND:
            raise ValueError(
                f"common backend {loaded_backend!r}: rl-megatron reads only {COMMON_BACKEND!r} checkpoints"
            )

    def load_common(self, checkpoint_dir: Any) -> Any:
        path = os.path.join(checkpoint_dir, COMMON_STATE_FNAME)
        if not os.path.isfile(path):
            raise mapping.CheckpointingException(f"Common file {path} does not exist")
        return torch_load(path, path)

    def load_sharded_objects(self, sharded_objects_state_dict: Any, checkpoint_dir: Any) -> Any:
        def load_one(sh_obj: Any) -> Any:
            path = os.path.join(checkpoint_dir, f"{sh_obj.unique_key}.pt")
            if not os.path.isfile(path):
                raise mapping.CheckpointingException(f"Object shard {path} not found")
            return torch_load(path, path)

        return dict_list_map_inplace(load_one, sharded_objects_state_dict)


@contextlib.contextmanager
def _safe_reader_and_planner(checkpoint_dir: str) -> Iterator[None]:
    """Make megatron's ``torch_dist`` strategy build :class:`SafeMetadataReader` s and :class:`SafeLoadPlanner` s."""
    names = {
        "_get_filesystem_reader": lambda path, cache_metadata=False: SafeMetadataReader(path),
        "MCoreLoadPlanner": functools.partial(SafeLoadPlanner, source=str(checkpoint_dir)),
    }
    missing = [name for name in names if not hasattr(torch_strategy, name)]
    if missing:
        raise RuntimeError(
            f"megatron-core no longer has {missing} in {torch_strategy.__name__}: "
            "rl_megatron.safe_load cannot make its checkpoint reads safe"
        )
    saved = {name: getattr(torch_strategy, name) for name in names}
    try:
        for name, value in names.items():
            setattr(torch_strategy, name, value)
        yield
    finally:
        for name, value in saved.items():
            setattr(torch_strategy, name, value)


def load(sharded_state: dict, checkpoint_dir: str) -> dict:
    """``dist_checkpointing.load(sharded_state, checkpoint_dir)`` with every read made safe. Collective."""
    return dist_checkpointing.load(
        sharded_state,
        checkpoint_dir,
        sharded_strategy=SafeTorchDistLoadStrategy(),
        common_strategy=SafeCommonLoadStrategy(),
    )


__all__ = ["SafeCommonLoadStrategy", "SafeLoadPlanner", "SafeMetadataReader", "SafeTorchDistLoadStrategy", "load"]
