"""Old import paths of the algorithms' sections, which moved into the algorithms' packages in rlcore 0.2.

``rlcore.config.grpo`` and its siblings are kept for one release: importing one warns, and a name read from it is
looked up in the module that now holds the algorithm's config class, found through the registry (the config layer
never imports an algorithm).
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from typing import Any


def moved_to_algorithm(old: str, algorithm: str, key: str | None = None, **kept: Any) -> Callable[[str], Any]:
    """The module ``__getattr__`` of the old module ``old``: names come from the module of ``algorithm``'s config
    class (or, with ``key``, of the top-level section it owns); ``kept``: names that stayed in the core."""
    warnings.warn(
        f"{old} moved into the '{algorithm}' algorithm's package (rlcore.algorithms.{algorithm}); import from there "
        "(the old path goes in the next minor release)",
        DeprecationWarning,
        stacklevel=3,
    )

    def __getattr__(name: str) -> Any:
        if name in kept:
            return kept[name]
        if name.startswith("__"):
            raise AttributeError(name)
        from rlcore.config.schemas import registered_algorithms

        spec = registered_algorithms()[algorithm]
        model = spec.load_config_class() if key is None else spec.load_section_class(key)
        try:
            return getattr(sys.modules[model.__module__], name)
        except AttributeError:
            raise AttributeError(f"module {old!r} has no attribute {name!r}") from None

    return __getattr__
