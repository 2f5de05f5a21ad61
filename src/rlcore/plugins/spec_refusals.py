"""Specs that fail validation inside a plugin's register hook: kept, with why, so the plugin's other specs register.

A plugin registers all its environments (or backends, or algorithms) from one hook call. Were a spec with a bad
field to raise there, the hook would stop at it, and every spec of the same plugin would be lost with it: one bad
spec would hide the others. While the registry calls a hook (:func:`recording_refusals`), a refused spec is made
anyway, unvalidated, and its refusal recorded; the registry lists it ``broken`` with that reason and registers the
others. Anywhere else (a plugin's own tests, user code), a refused spec raises as it always did.
"""

from __future__ import annotations

import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import cast

from pydantic import BaseModel, ValidationError


@dataclass
class Refusal:
    """A spec the plugin made that failed validation: the fields it gave, the error, and where it was made."""

    spec: BaseModel
    fields: dict[str, object]
    error: ValidationError
    where: str


_REFUSALS: ContextVar[list[Refusal] | None] = ContextVar("rlcore_spec_refusals", default=None)


@contextmanager
def recording_refusals() -> Iterator[list[Refusal]]:
    """Within the block, specs that fail validation are made anyway and listed in the yielded list."""
    refusals: list[Refusal] = []
    token = _REFUSALS.set(refusals)
    try:
        yield refusals
    finally:
        _REFUSALS.reset(token)


def refusal_of(spec: object, refusals: list[Refusal]) -> Refusal | None:
    """The refusal recorded for this very object (by identity: a refused spec cannot be compared by value)."""
    return next((r for r in refusals if r.spec is spec), None)


class KeptWhenRefused:
    """Mixin for a pydantic spec model: refused inside :func:`recording_refusals`, it is kept with its refusal."""

    def __init__(self, /, **data: object) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            refusals = _REFUSALS.get()
            if refusals is None:
                raise
            caller = traceback.extract_stack(limit=2)[0]  # the plugin's line that made the spec
            model = cast(BaseModel, self)  # the mixin is for pydantic models only
            _fill_unvalidated(model, data)
            refusals.append(Refusal(model, dict(data), exc, f"{caller.filename}:{caller.lineno}"))


def _fill_unvalidated(spec: BaseModel, data: dict[str, object]) -> None:
    """Give the half-made model the fields it was given, as pydantic's ``model_construct`` would."""
    made = type(spec).model_construct(None, **{k: v for k, v in data.items() if k in type(spec).model_fields})
    for attr in ("__dict__", "__pydantic_fields_set__", "__pydantic_extra__", "__pydantic_private__"):
        object.__setattr__(spec, attr, getattr(made, attr))


__all__ = ["KeptWhenRefused", "Refusal", "recording_refusals", "refusal_of"]
