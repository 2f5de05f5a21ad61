"""The user's code in the log: where an environment (or a reward function) raised, once per distinct error.

A sample whose scoring raises gets reward 0 and counts in ``env/errors``; that
metric says how often, not where. :func:`failure_of` reads the exception at
the place it is caught (in the driver or in an environment actor) into a
picklable :class:`SampleFailure`: its type, the file and line of the user's
code it came from, and its traceback. :class:`FailureLog` keeps each distinct
error (type, file, line) once in ``<output_dir>/logs/environment_errors.log``,
with its traceback and how many samples it failed, rewritten as the counts
grow, so a reward that raises on 3,000 samples writes one traceback, not 3,000.
"""

from __future__ import annotations

import os
import sysconfig
import traceback
from dataclasses import dataclass
from pathlib import Path

#: The log file, in the run's ``logs/`` directory.
FILE_NAME = "environment_errors.log"


@dataclass(frozen=True)
class SampleFailure:
    """One sample's exception: ``error`` (``Type: message``, one line), the user's ``file``:``line``, the
    traceback's text."""

    error: str
    file: str
    line: int
    traceback: str

    @property
    def key(self) -> tuple[str, str, int]:
        """What makes two failures the same error: the exception type and where it was raised."""
        return self.error.split(":", 1)[0], self.file, self.line

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


def failure_of(exc: BaseException) -> SampleFailure:
    """``exc`` as a :class:`SampleFailure`, located at the user's line (:func:`user_frame`)."""
    frames = traceback.extract_tb(exc.__traceback__)
    frame = user_frame(frames)
    return SampleFailure(
        error=f"{type(exc).__name__}: {' '.join(str(exc).split())}",
        file=frame.filename if frame else "<unknown>",
        line=(frame.lineno or 0) if frame else 0,
        traceback="".join(traceback.format_exception(exc)),
    )


def user_frame(frames: list[traceback.FrameSummary]) -> traceback.FrameSummary | None:
    """The frame to name: of the frames rlcore called (after its last own frame), the deepest in the user's
    code, leaving out the standard library and installed packages (where the user's code called them) unless
    the code rlcore called lives there itself (an installed plugin); the deepest frame when rlcore itself raised."""
    if not frames:
        return None
    own = str(Path(__file__).resolve().parents[1]) + os.sep
    last_own = max((i for i, f in enumerate(frames) if _resolved(f.filename).startswith(own)), default=-1)
    called = frames[last_own + 1 :]
    if not called:
        return frames[-1]
    libraries = _library_dirs()
    entry = _resolved(called[0].filename)
    entry_root = next(
        (entry[: len(d)] + entry[len(d) :].split(os.sep, 1)[0] + os.sep for d in libraries if entry.startswith(d)), None
    )
    for frame in reversed(called):
        path = _resolved(frame.filename)
        if (entry_root is not None and path.startswith(entry_root)) or not any(path.startswith(d) for d in libraries):
            return frame
    return called[0]


def _resolved(filename: str) -> str:
    return str(Path(filename).resolve()) if filename and not filename.startswith("<") else filename


def _library_dirs() -> list[str]:
    paths = sysconfig.get_paths()
    dirs = {
        str(Path(paths[name]).resolve()) + os.sep
        for name in ("stdlib", "platstdlib", "purelib", "platlib")
        if name in paths
    }
    return sorted(dirs, key=len, reverse=True)


class FailureLog:
    """Each distinct :class:`SampleFailure` of the environment ``env_name`` once, with its count, in
    ``<log_dir>/environment_errors.log`` (no file when ``log_dir`` is None)."""

    def __init__(self, env_name: str, log_dir: Path | None = None) -> None:
        self.env_name = env_name
        self.path = Path(log_dir) / FILE_NAME if log_dir is not None else None
        self.counts: dict[tuple[str, str, int], list] = {}  # key -> [first failure, count]
        self.written: Path | None = None  # the file, once written (an unwritable directory leaves it None)

    def add(self, failures: list[SampleFailure]) -> None:
        """Count ``failures``; rewrite the file when there were any."""
        for failure in failures:
            self.counts.setdefault(failure.key, [failure, 0])[1] += 1
        if failures and self.path is not None:
            self._write()

    def _write(self) -> None:
        entries = sorted(self.counts.values(), key=lambda entry: -entry[1])
        total = sum(count for _, count in entries)
        lines = [
            f"rlcore: environment '{self.env_name}' raised {len(entries)} distinct error"
            f"{'s' if len(entries) != 1 else ''} on {total} sample{'s' if total != 1 else ''} (each error once, "
            "the traceback of its first sample; the counts are the run's so far)\n"
        ]
        for failure, count in entries:
            lines.append(
                f"\n--- {failure.key[0]} at {failure.where}: {count} sample{'s' if count != 1 else ''}; "
                f"the first: {failure.error}\n{failure.traceback}"
            )
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            partial = self.path.with_name(f".{FILE_NAME}.partial")
            partial.write_text("".join(lines))
            os.replace(partial, self.path)
            self.written = self.path
        except OSError:  # an unwritable log directory costs the log, not the run
            pass


__all__ = ["FILE_NAME", "FailureLog", "SampleFailure", "failure_of", "user_frame"]
