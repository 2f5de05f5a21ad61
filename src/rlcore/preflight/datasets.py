"""Hub datasets (``data.train.hub_id``, ``data.validation.hub_id``) that cannot load: offline
(``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE``) with no cached copy. One line each, naming the download command;
checked on the cache folders alone (no ``datasets`` import, no network), so it answers in well under a second."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlcore.config import DataConfig


def dataset_problems(data: DataConfig) -> list[str]:
    """One line per hub dataset the ``data`` section names that this offline machine has no copy of."""
    from rlcore.datasets.hub import missing_line, missing_offline

    problems = []
    for key, entry in (("data.train.hub_id", data.train), ("data.validation.hub_id", data.validation)):
        if entry is not None and entry.hub_id is not None and missing_offline(entry.hub_id, entry.revision):
            problems.append(missing_line(key, entry.hub_id, entry.revision))
    return problems
