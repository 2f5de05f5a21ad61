"""Errors a run stops with whose message is already one line in rlcore's words (the cause and the fix), so
``rlcore run`` prints it as it is, without the exception's type (:func:`rlcore.cli.errors.one_line`)."""

from __future__ import annotations


class RunError(RuntimeError):
    """A run stopped for a reason its message says in one line."""


__all__ = ["RunError"]
