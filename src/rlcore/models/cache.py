"""The on-disk cache of tiny models: each set of build arguments is built once, shared by processes."""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from rlcore.models.build import BUILD_VERSION, LATER_ARGUMENTS, build_tiny_model
from rlcore.models.vlm import VLM_ARCH, VLM_BUILD_VERSION, build_tiny_vlm

_BUILD_SIGNATURE = inspect.signature(build_tiny_model)
_VLM_SIGNATURE = inspect.signature(build_tiny_vlm)


def default_cache_root() -> Path:
    """``$RLCORE_CACHE/tiny-models`` if set, else ``~/.cache/rlcore/tiny-models``."""
    base = os.environ.get("RLCORE_CACHE")
    root = Path(base) if base else Path.home() / ".cache" / "rlcore"
    return root / "tiny-models"


def tiny_model_path(cache_root: str | os.PathLike | None = None, **kwargs: Any) -> str:
    """Path of a tiny model built with ``build_tiny_model(**kwargs)``, built at most once.

    ``arch="qwen2_5_vl"`` builds with :func:`rlcore.models.vlm.build_tiny_vlm` instead
    (its own arguments, its own build version in the key).

    The directory name is a hash of the (normalised) arguments, the
    transformers version and a build version. The model is built in a temporary
    sibling directory and renamed into place, so concurrent test processes
    never see a half-written model: whoever renames first wins, the others
    discard their copy.
    """
    from importlib.metadata import version  # not ``import transformers``: a second and a half on a CPU machine

    if kwargs.get("arch") == VLM_ARCH:
        key = _vlm_key(kwargs)
    else:
        # Normalise through the signature so that defaults given explicitly hash the same.
        bound = _BUILD_SIGNATURE.bind("<dir>", **kwargs)
        bound.apply_defaults()
        # Arguments added later are left out at their default (None), so older cached models keep their key.
        key = {
            name: str(value)
            for name, value in bound.arguments.items()
            if name != "save_dir" and not (name in LATER_ARGUMENTS and value is None)
        }
        key["_build"] = str(BUILD_VERSION)
    key["dtype"] = key["dtype"].removeprefix("torch.")
    key["_transformers"] = version("transformers")
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    root = Path(cache_root) if cache_root is not None else default_cache_root()
    final = root / f"{key['arch']}-{digest}"
    if (final / "config.json").exists():
        return str(final)

    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
    try:
        if key["arch"] == VLM_ARCH:
            build_tiny_vlm(tmp, **kwargs)
        else:
            build_tiny_model(tmp, **kwargs)
        try:
            os.rename(tmp, final)
        except OSError:
            # Another process finished first (the target exists and is non-empty).
            if not (final / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(final)


def _vlm_key(kwargs: dict[str, Any]) -> dict[str, str]:
    """The cache key of ``build_tiny_vlm(**kwargs)``: every argument (sequences as lists), and the VLM build version."""
    bound = _VLM_SIGNATURE.bind("<dir>", **kwargs)
    bound.apply_defaults()
    key = {
        name: str(list(value) if isinstance(value, tuple) else value)
        for name, value in bound.arguments.items()
        if name != "save_dir"
    }
    key["_build"] = f"vlm-{VLM_BUILD_VERSION}"
    return key
