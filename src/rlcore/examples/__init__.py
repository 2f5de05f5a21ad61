"""The example configs that ship with rlcore, by name (``grpo_tiny``, ``grpo_megatron``, ...).

They are package data, so an installed rlcore has them without a checkout:
``rlcore examples list``, ``rlcore examples copy NAME``, and ``rlcore run NAME``
(``rlcore run`` alone runs :data:`DEFAULT_EXAMPLE`). In a checkout,
``examples/*.yaml`` are links to these files.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

#: What ``rlcore run`` trains when given no config: the README's first command.
DEFAULT_EXAMPLE = "grpo_tiny"


def _files():
    return resources.files(__name__)


def example_names() -> list[str]:
    """Every shipped example, sorted."""
    return sorted(f.name.removesuffix(".yaml") for f in _files().iterdir() if f.name.endswith(".yaml"))


def example_path(name: str) -> Path:
    """The file of example ``name`` (``grpo_tiny`` or ``grpo_tiny.yaml``); KeyError naming the choices."""
    stem = name.removesuffix(".yaml")
    if stem not in example_names():
        raise KeyError(f"no example named {name!r}; the examples are: {', '.join(example_names())}")
    return Path(str(_files() / f"{stem}.yaml"))


def example_summary(name: str) -> str:
    """The first line of the example's header comment."""
    for line in example_path(name).read_text().splitlines():
        if line.startswith("#"):
            return line.lstrip("# ").strip()
    return ""


__all__ = ["DEFAULT_EXAMPLE", "example_names", "example_path", "example_summary"]
