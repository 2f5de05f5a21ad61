"""Where Hugging Face keeps its caches, as this process's environment says now (the libraries read it once, at
import; a test or a caller may have changed it since)."""

from __future__ import annotations

import os


def hf_home() -> str:
    """HF_HOME, else the default ``~/.cache/huggingface`` (XDG_CACHE_HOME honoured)."""
    return os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface"
    )


def hub_cache_dir() -> str:
    """The hub cache (``hf download``'s): HF_HUB_CACHE, else HF_HOME/hub."""
    return os.environ.get("HF_HUB_CACHE") or os.path.join(hf_home(), "hub")


def datasets_cache_dir() -> str:
    """``datasets``' own cache (prepared Arrow files): HF_DATASETS_CACHE, else HF_HOME/datasets."""
    return os.environ.get("HF_DATASETS_CACHE") or os.path.join(hf_home(), "datasets")
