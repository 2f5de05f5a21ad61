"""Rows of a Hugging Face hub dataset (``data.<split>.hub_id``), loaded with ``datasets.load_dataset``.

Online, ``load_dataset`` downloads the dataset into its cache (or finds it there). Offline (``HF_HUB_OFFLINE`` or
``HF_DATASETS_OFFLINE``), ``datasets`` alone finds only what it prepared before; a copy that ``hf download
--repo-type dataset <id>`` put in the hub cache is found here (``huggingface_hub``'s snapshot, without the
network) and loaded from its files. A dataset in neither cache is one :class:`DataError` line naming the command
that downloads it.
"""

from __future__ import annotations

import os
from typing import Any

from rlcore.datasets.caches import datasets_cache_dir, hub_cache_dir
from rlcore.datasets.files import DataError

_TRUE = {"1", "true", "yes", "on"}


def offline() -> bool:
    """Whether the hub is switched off for this process (as ``huggingface_hub`` and ``datasets`` read it)."""
    return any(os.environ.get(name, "").strip().lower() in _TRUE for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def download_command(hub_id: str, revision: str | None = None) -> str:
    """The command that puts ``hub_id`` in the hub cache, for a machine that reaches the hub."""
    return f"hf download --repo-type dataset {hub_id}" + (f" --revision {revision}" if revision else "")


def cached_snapshot(hub_id: str, revision: str | None = None) -> str | None:
    """The hub cache's folder holding ``hub_id`` at ``revision`` (None: not downloaded), without the network."""
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(
            hub_id, repo_type="dataset", revision=revision, local_files_only=True, cache_dir=hub_cache_dir()
        )
    except Exception:  # noqa: BLE001 - not cached, or a name the hub would refuse: either way no local copy
        return None


def _datasets_cache_holds(hub_id: str) -> bool:
    """Whether ``datasets``' own cache holds a prepared copy of ``hub_id`` (a load made earlier, online)."""
    return os.path.isdir(os.path.join(datasets_cache_dir(), hub_id.replace("/", "___")))


def missing_offline(hub_id: str, revision: str | None = None) -> bool:
    """Offline, and neither cache holds ``hub_id``: loading it would fail."""
    return offline() and cached_snapshot(hub_id, revision) is None and not _datasets_cache_holds(hub_id)


def missing_line(key: str, hub_id: str, revision: str | None = None) -> str:
    """The one line for a hub dataset that is not cached on an offline machine; ``key``: its setting."""
    return (
        f"{key}: {hub_id} is not in the hub cache and the hub is off (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE); "
        f"download it where the hub is reachable: {download_command(hub_id, revision)} (then copy HF_HOME "
        f"here), or give a local copy of the rows as the path"
    )


def read_hub_rows(cfg: Any, key: str = "data.train.hub_id") -> Any:
    """The rows of ``cfg`` (a :class:`rlcore.config.data.DatasetConfig` with ``hub_id``) as a memory-mapped
    ``datasets.Dataset``."""
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"{key}: loading a hub dataset needs Hugging Face datasets: pip install 'rlcore[data]'"
        ) from None
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    split = cfg.split or "train"
    source, revision = cfg.hub_id, cfg.revision
    if offline():
        snapshot = cached_snapshot(cfg.hub_id, cfg.revision)
        if snapshot is not None:
            source, revision = snapshot, None
        elif not _datasets_cache_holds(cfg.hub_id):
            raise DataError(missing_line(key, cfg.hub_id, cfg.revision))
    try:
        return datasets.load_dataset(
            source,
            name=cfg.subset,
            split=split,
            revision=revision,
            data_files=cfg.data_files,
            cache_dir=datasets_cache_dir(),
        )
    except Exception as exc:  # noqa: BLE001 - datasets' many error types, reported as one line
        raise DataError(
            f"{key}: datasets.load_dataset({cfg.hub_id!r}, name={cfg.subset!r}, split={split!r}) "
            f"failed: {' '.join(str(exc).split())[:300]}"
        ) from None
