"""A sample's image, from any form a row gives it in, decoded into an RGB ``PIL.Image``.

The forms: a ``PIL.Image``; a Hugging Face ``datasets`` ``Image`` value (``{"bytes": ..., "path": ...}``, what
an undecoded column holds); the bytes of an image file (PNG, JPEG, anything Pillow reads); a ``data:image/...;
base64,`` URL (NeMo-RL's CLEVR and Geometry3K rows carry their images so); or the path of an image file, a relative
one against the data file's directory. An image is decoded when its sample is built, once, into pixels held in
memory (no file stays open), so the engine and the trainer are handed the very same pixels later.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
from pathlib import Path
from typing import TYPE_CHECKING

from rlcore.datasets.files import DataError, special_file_kind

if TYPE_CHECKING:
    from PIL import Image

_FORMS = "a PIL image, the bytes of a PNG or JPEG file, a path, a data:image URL or a datasets Image value"


def decode_image(source: object, where: str, what: str, base_dir: Path | None = None) -> Image.Image:
    """``source`` as an RGB image. ``where`` names the row and ``what`` the column or message part in errors
    (one :class:`DataError` line); ``base_dir``: what a relative path is relative to (None: the working
    directory)."""
    from PIL import Image

    if isinstance(source, dict) and ("bytes" in source or "path" in source):
        if source.get("bytes") is not None:
            source = source["bytes"]
        elif source.get("path") is not None:
            source = source["path"]
        else:
            raise DataError(f"{where}: {what}: an image value with neither bytes nor path; give one of them")
    if isinstance(source, Image.Image):
        return _rgb(source, where, what, "the image")
    if isinstance(source, (bytes, bytearray, memoryview)):
        return _decode(bytes(source), where, what, f"{len(source)} bytes")
    if isinstance(source, str) and source.startswith("data:"):
        return _decode(_data_url_bytes(source, where, what), where, what, "the data URL")
    if isinstance(source, str) and "://" in source:
        raise DataError(
            f"{where}: {what}: {source[:80]} is a URL, which rlcore does not fetch: download it, give a path"
        )
    if isinstance(source, (str, os.PathLike)):
        path = _resolved(Path(source), base_dir)
        return _decode(_file_bytes(path, where, what), where, what, f"file {path}")
    raise DataError(f"{where}: {what}: is {type(source).__name__}, not an image; give {_FORMS}")


def _rgb(image: Image.Image, where: str, what: str, described: str) -> Image.Image:
    """A copy of ``image`` in RGB, its pixels loaded (a lazily read image reads its file now)."""
    try:
        return image.convert("RGB")
    except Exception as exc:  # noqa: BLE001 - Pillow's decoders raise many types; each is one line here
        raise _unreadable(exc, where, what, described) from None


def _decode(data: bytes, where: str, what: str, described: str) -> Image.Image:
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()
            return image.convert("RGB")
    except Exception as exc:  # noqa: BLE001
        raise _unreadable(exc, where, what, described) from None


def _unreadable(exc: Exception, where: str, what: str, described: str) -> DataError:
    from PIL import UnidentifiedImageError

    why = "not a format Pillow reads" if isinstance(exc, UnidentifiedImageError) else " ".join(str(exc).split())
    return DataError(f"{where}: {what}: {described}: not a readable image ({why}); give {_FORMS}")


def _data_url_bytes(url: str, where: str, what: str) -> bytes:
    header, comma, payload = url.partition(",")
    if not (comma and header.startswith("data:image/") and header.endswith(";base64")):
        raise DataError(f"{where}: {what}: a data URL must read 'data:image/<type>;base64,<data>'; got {url[:40]}...")
    try:
        return base64.b64decode(payload, validate=True)
    except binascii.Error as exc:
        raise DataError(f"{where}: {what}: the data URL's base64 does not decode ({exc})") from None


def _resolved(path: Path, base_dir: Path | None) -> Path:
    path = path.expanduser()
    return base_dir / path if base_dir is not None and not path.is_absolute() else path


def _file_bytes(path: Path, where: str, what: str) -> bytes:
    try:
        if (kind := special_file_kind(path)) is not None:
            raise DataError(f"{where}: {what}: {path} is {kind}, not an image file; give an image file's path")
        return path.read_bytes()
    except OSError as exc:
        raise DataError(f"{where}: {what}: cannot read image file {path}: {exc.strerror or exc}") from None
