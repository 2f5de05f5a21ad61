"""A Hugging Face hub cache built on disk, as ``hf download --repo-type dataset <id>`` leaves it, for tests that
stand it in for the hub (no network): parquet files, and a README whose ``configs`` name each subset's splits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(
    home: Path, hub_id: str, files: dict[str, list[dict[str, Any]]], configs: dict[str, dict[str, str]] | None = None
) -> Path:
    """The hub cache (under ``home``, an HF_HOME) of one dataset repo at one commit: ``files`` (path → rows, written
    as parquet; other suffixes as given bytes) and, with ``configs`` (subset → split → file), the README's
    ``configs`` metadata by which ``datasets`` finds a subset's files."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    repo = home / "hub" / f"datasets--{hub_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    for name, rows in files.items():
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        if isinstance(rows, bytes):
            (snapshot / name).write_bytes(rows)
        else:
            pq.write_table(pa.Table.from_pylist(rows), snapshot / name)
    if configs:
        lines = ["---", "configs:"]
        for subset, splits in configs.items():
            lines += [f"- config_name: {subset}", "  data_files:"]
            lines += [f"  - split: {split}\n    path: {path}" for split, path in splits.items()]
        (snapshot / "README.md").write_text("\n".join([*lines, "---", ""]))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return repo


@pytest.fixture
def offline_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty HF_HOME with the hub and datasets offline, as on a machine that cannot reach the hub."""
    home = tmp_path / "hf"
    for name, value in (("HF_HOME", str(home)), ("HF_HUB_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1")):
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HF_DATASETS_CACHE", raising=False)
    return home
