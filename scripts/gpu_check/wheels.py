"""Step 1 of ``make gpu-check``, before pip: the wheel files to install from ``--wheels`` folders.

Halves of a wheel split for a transfer limit (``NAME.whl.part-aa``, ``-ab``, ...) are joined, the
machine's own CUDA stack is never replaced, and of two versions the newer one is kept. Installing
them is :mod:`install`'s job.
"""

from __future__ import annotations

import importlib.metadata
import re
import shutil
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

#: Distributions a wheel folder must never replace: the machine's own CUDA stack.
PROTECTED = re.compile(r"^(torch|torchvision|torchaudio|triton|nvidia-.*|cuda-.*|jax.*)$")


def _natural(text: str) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def wheel_name(path: Path) -> tuple[str, str]:
    """(normalised distribution name, version) from a wheel's file name."""
    parts = path.name[: -len(".whl")].split("-")
    if len(parts) < 5:
        raise ValueError(f"{path.name} is not a wheel file name")
    return re.sub(r"[-_.]+", "-", parts[0]).lower(), parts[1]


def _version_key(version: str) -> Any:
    try:
        from packaging.version import Version

        return Version(version)
    except Exception:  # noqa: BLE001 - no packaging, or an odd version string
        return _natural(version)


def collect_wheels(folders: Iterable[Path], work: Path) -> tuple[list[Path], list[str]]:
    """Wheels under ``folders`` (recursively), split wheels joined into ``work``; returns (wheels, notes).

    ``NAME.whl.part-*`` files are concatenated in natural order into ``work/NAME.whl`` and kept
    only if the result is a valid zip (a missing half is reported, not installed). Protected
    distributions are left out; of two versions of one distribution the newer is kept.
    """
    notes: list[str] = []
    found: list[Path] = []
    parts: dict[str, list[Path]] = {}
    for folder in folders:
        if not folder.is_dir():
            notes.append(f"wheel folder {folder} does not exist")
            continue
        for path in folder.rglob("*"):
            if path.is_file() and path.name.endswith(".whl"):
                found.append(path)
            elif path.is_file() and ".whl.part" in path.name:
                parts.setdefault(path.name[: path.name.index(".whl.part") + 4], []).append(path)
    for name, pieces in sorted(parts.items()):
        if any(p.name == name for p in found):
            continue  # the whole wheel is there too
        pieces.sort(key=lambda p: _natural(p.name))
        work.mkdir(parents=True, exist_ok=True)
        joined = work / name
        with open(joined, "wb") as out:
            for piece in pieces:
                with open(piece, "rb") as src:
                    shutil.copyfileobj(src, out, 16 << 20)
        try:
            with zipfile.ZipFile(joined) as archive:
                bad = archive.testzip()
            if bad is not None:
                raise zipfile.BadZipFile(f"bad CRC in {bad}")
        except (zipfile.BadZipFile, OSError) as exc:
            joined.unlink(missing_ok=True)
            notes.append(
                f"{name}: joining {len(pieces)} part(s) ({', '.join(p.name for p in pieces)}) does not give "
                f"a valid wheel ({exc}); a part is missing or damaged"
            )
            continue
        notes.append(f"{name}: joined from {len(pieces)} parts")
        found.append(joined)
    newest: dict[str, Path] = {}
    for path in sorted(found, key=lambda p: p.name):
        try:
            dist, _ = wheel_name(path)
        except ValueError as exc:
            notes.append(str(exc))
            continue
        if PROTECTED.match(dist):
            notes.append(f"{path.name}: left out (the machine's own {dist} is used)")
            continue
        if dist in newest:
            other = newest[dist]
            keep, drop = sorted([other, path], key=lambda p: _version_key(wheel_name(p)[1]))[::-1]
            notes.append(f"{drop.name}: left out ({keep.name} is newer)")
            newest[dist] = keep
        else:
            newest[dist] = path
    return sorted(newest.values(), key=lambda p: p.name), notes


def installed_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def wheels_to_install(wheels: list[Path], installed: Any = installed_version) -> tuple[list[Path], list[str]]:
    """The wheels that add or upgrade a distribution (an installed newer or equal version is kept)."""
    chosen, notes = [], []
    for path in wheels:
        dist, version = wheel_name(path)
        have = installed(dist)
        if have is not None and _version_key(have) >= _version_key(version):
            notes.append(f"{dist}: {have} already installed (wheel {version} not needed)")
            continue
        chosen.append(path)
    return chosen, notes
