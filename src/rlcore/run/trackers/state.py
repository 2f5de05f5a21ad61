"""``<output_dir>/trackers.json``: each tracker's run id and the last step it logged, so ``--resume`` continues
the same run and does not log a step twice.

A record is ``{"run_id": ..., "where": ..., "last_step": N}``; ``where`` names the project or store the run lives
in, and a resumed run whose config points elsewhere starts a new run there.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FILE_NAME = "trackers.json"


class TrackerState:
    """The trackers' records of one output directory, written through after every change."""

    def __init__(self, output_dir: str | Path) -> None:
        self.path = Path(output_dir) / FILE_NAME
        self.records: dict[str, dict[str, Any]] = {}
        if self.path.exists():
            try:
                loaded = json.loads(self.path.read_text())
            except (OSError, ValueError):
                loaded = {}  # a torn write: the runs start afresh rather than the training failing
            self.records = {k: v for k, v in loaded.items() if isinstance(v, dict)} if isinstance(loaded, dict) else {}

    def previous(self, name: str, where: str) -> dict[str, Any] | None:
        """The record of ``name``'s run in ``where``, if the last run in this output directory had one."""
        record = self.records.get(name)
        if record and record.get("where") == where and record.get("run_id"):
            return record
        return None

    def started(self, name: str, run_id: str, where: str, last_step: int | None) -> None:
        self.records[name] = {"run_id": run_id, "where": where, "last_step": last_step}
        self._write()

    def logged(self, name: str, step: int) -> None:
        record = self.records[name]
        if record.get("last_step") is None or step > record["last_step"]:
            record["last_step"] = step
            self._write()

    def _write(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.records, indent=1, sort_keys=True) + "\n")
        tmp.replace(self.path)
