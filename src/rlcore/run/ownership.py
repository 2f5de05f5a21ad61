"""Who owns an output directory: the marker a run writes in ``logger.output_dir``, and the refusal of a run
pointed at a directory that holds another run's results.

Two runs that share an output directory destroy each other silently (NeMo-RL's ``sft.yaml`` and ``dpo.yaml``
both log to ``logs``): the second replaces the first's checkpoints and appends its rows to the first's
``metrics.jsonl``. So a run writes :data:`MARKER` (its config hash, algorithm, start time and rlcore version),
and a fresh run (no ``--resume``) refuses a directory holding a run's results, a step checkpoint or metrics
rows, whoever wrote them: the same config's run (continue it with ``--resume``), another run, or a run from
before markers. ``--resume`` continues a run of the same algorithm only. A directory without results (a run
that stopped before its first step, or files that are not a run's) is used as before.
"""

from __future__ import annotations

import hashlib
import json
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from rlcore.run.errors import RunError

#: The file a run writes in its ``logger.output_dir``.
MARKER = "rlcore-run.json"


class OutputDirTaken(RunError):
    """``logger.output_dir`` holds another run's results (or, with ``--resume``, another algorithm's run)."""


class OutputDirLock:
    """An exclusive hold on ``logger.output_dir`` for as long as one run writes it: an advisory ``flock`` on the
    directory itself, so two runs started at the same moment cannot both pass the ownership check (the loser
    is refused in one line), and a run that dies, however, lets go with its process (no stale lock file).

    Holds nest within a process (``rlcore run`` holds the directory from its checks on, and :func:`train`
    holds it again): only the outermost takes and drops the lock."""

    def __init__(self, out: Path) -> None:
        import fcntl

        out.mkdir(parents=True, exist_ok=True)
        self.path = out
        self._key = os.path.realpath(out)
        self._held = False
        if self._key not in _HELD:
            fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise OutputDirTaken(
                    f"logger.output_dir: {out} is being written by another rlcore run right now; wait for it to "
                    f"end, or write this run to a fresh directory (-o logger.output_dir={fresh_directory(out, 'new')})"
                ) from None
            _HELD[self._key] = [fd, 0]
        _HELD[self._key][1] += 1
        self._held = True

    def release(self) -> None:
        """Let the directory go (the outermost hold closes the descriptor, which drops the lock)."""
        if not self._held:
            return
        self._held = False
        entry = _HELD[self._key]
        entry[1] -= 1
        if entry[1] == 0:
            del _HELD[self._key]
            os.close(entry[0])

    def __enter__(self) -> OutputDirLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


#: The directories this process holds: ``{real path: [descriptor, holds]}``.
_HELD: dict[str, list[int]] = {}


def config_hash(cfg: Any) -> str:
    """A short hash of the resolved config, its output directory left out (the same config elsewhere hashes
    the same)."""
    dumped = cfg.model_dump(mode="json")
    dumped.get("logger", {}).pop("output_dir", None)
    return hashlib.sha256(json.dumps(dumped, sort_keys=True, default=str).encode()).hexdigest()[:16]


def read_marker(out: Path) -> dict[str, Any] | None:
    """The directory's marker; None when it has none, ``{}`` when it cannot be read."""
    path = Path(out) / MARKER
    if not path.is_file():
        return None
    try:
        marker = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return marker if isinstance(marker, dict) else {}


def write_marker(cfg: Any, resume: bool) -> Path:
    """Claim ``logger.output_dir`` for this run (atomically). A resumed run keeps the first start time and
    records its own."""
    from rlcore import __version__

    out = Path(cfg.logger.output_dir)
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    old = read_marker(out) if resume else None
    marker = {
        "algorithm": cfg.algorithm,
        "config_hash": config_hash(cfg),
        "started": now,
        "rlcore_version": __version__,
    }
    if old:
        marker = {**marker, "started": old.get("started", now), "resumed": [*old.get("resumed", []), now]}
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{MARKER}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(marker, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, out / MARKER)
    return out / MARKER


def run_results(cfg: Any) -> list[str]:
    """What of a run's results ``logger.output_dir`` holds: ``checkpoints/`` (a step checkpoint, whole or not)
    and a non-empty ``metrics.jsonl``."""
    from rlcore.run.checkpoints import checkpoint_root

    out = Path(cfg.logger.output_dir)
    root = checkpoint_root(cfg)
    found = []
    if root.is_dir() and (any(root.glob("step_*")) or any(root.glob(".step_*"))):
        found.append("checkpoints/")
    metrics = out / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        found.append("metrics.jsonl")
    return found


def ownership_problems(cfg: Any, resume: bool) -> list[str]:
    """Why this run may not write ``logger.output_dir``, one line (empty when it may): a fresh run where a run's
    results are, or ``--resume`` of another algorithm's run. Reads only; before Ray."""
    out = Path(cfg.logger.output_dir)
    marker = read_marker(out)
    if resume:
        owner = (marker or {}).get("algorithm")
        if owner is None or owner == cfg.algorithm:
            return []
        return [
            f"--resume: {out} holds {_owner(marker)}, and this config trains {cfg.algorithm}; resume it with "
            f"the config it was started with, or write this {cfg.algorithm} run to a fresh directory "
            f"(-o logger.output_dir={fresh_directory(out, cfg.algorithm)})"
        ]
    if not (results := run_results(cfg)):
        return []
    held = ", ".join(results)
    if marker and marker.get("config_hash") == config_hash(cfg):
        return [
            f"logger.output_dir: {out} holds this config's run ({held}; started {marker.get('started')}), "
            f"which a fresh start would overwrite; continue it with --resume, or start again in a fresh "
            f"directory (-o logger.output_dir={fresh_directory(out, '')})"
        ]
    if marker is None:
        whose = f"a run's files ({held}) from before rlcore marked its runs ({MARKER})"
    else:
        whose = f"{_owner(marker)} ({held})"
    return [
        f"logger.output_dir: {out} holds {whose}, which this run would overwrite; write this run to a fresh "
        f"directory (-o logger.output_dir={fresh_directory(out, cfg.algorithm)}), or continue that run with "
        "--resume and its own config"
    ]


def _owner(marker: dict[str, Any] | None) -> str:
    """``'the sft run started 2026-11-28T13:50:02+00:00'`` (what can be said of it)."""
    if not marker:
        return f"a run whose {MARKER} cannot be read"
    return f"the {marker.get('algorithm', 'unknown')} run started {marker.get('started', 'at an unknown time')}"


def fresh_directory(out: Path, suffix: str) -> Path:
    """A directory beside ``out`` that does not exist yet: ``<out>-<suffix>``, else with a number."""
    base = f"{out}-{suffix}" if suffix else str(out)
    for n in range(1 if suffix else 2, 1000):
        candidate = Path(base if n == 1 else f"{base}-{n}")
        if not candidate.exists():
            return candidate
    return Path(f"{base}-new")


__all__ = [
    "MARKER",
    "OutputDirLock",
    "OutputDirTaken",
    "config_hash",
    "fresh_directory",
    "ownership_problems",
    "read_marker",
    "run_results",
    "write_marker",
]
