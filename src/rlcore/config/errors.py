"""The one exception every config problem surfaces as."""

from __future__ import annotations

from collections.abc import Iterable


class ConfigError(Exception):
    """A config could not be loaded; ``problems`` holds one line per issue.

    ``str()`` is exactly those lines joined by newlines, so a CLI can print it
    as-is: no traceback, no pydantic boilerplate. Lines look like
    ``policy.train_micro_batch_size: expected an integer, got 'abc'``.
    """

    def __init__(self, problems: Iterable[str], source: str | None = None) -> None:
        self.problems: list[str] = list(problems) or ["invalid config"]
        self.source = source  # the file the problems came from, when there is one
        super().__init__("\n".join(self.problems))

    def __str__(self) -> str:
        return "\n".join(self.problems)
