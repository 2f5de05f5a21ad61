"""Errors a run stops with whose message is already one line in rlcore's words (the cause and the fix), so
``rlcore run`` prints it as it is, without the exception's type (:func:`rlcore.cli.errors.one_line`)."""

from __future__ import annotations

from collections.abc import Iterator


class RunError(RuntimeError):
    """A run stopped for a reason its message says in one line."""


def error_chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc``, then each error behind it (its ``__cause__``, else its ``__context__``), each once."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


__all__ = ["RunError", "error_chain"]
