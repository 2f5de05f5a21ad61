"""Base classes shared by every config section.

Config objects are values: every section is frozen, and ``model_copy(update=...)``
validates again (what the user gave plus the changes), so a value derived from
another field (:func:`derived`) can never go stale. ``StrictModel`` rejects
unknown keys. ``SectionsModel`` additionally lets a
section carry backend-specific sub-sections (``vllm_cfg``, ``mybackend_cfg``)
that the core does not know: any undeclared key ending in ``_cfg`` is moved
into ``backend_sections`` before validation and written back under its own
name when dumping. The plugin registry validates those sections later against
the owning backend's config class (see ``rlcore.config.validate_section``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

SECTION_SUFFIX = "_cfg"
SECTIONS_FIELD = "backend_sections"

M = TypeVar("M", bound=BaseModel)


class StrictModel(BaseModel):
    """A config section: unknown keys are errors, values are not coerced, and the object is frozen.

    Strict typing means ``true`` is not an integer and ``"2"`` is not a
    number: a YAML value of the wrong kind is reported rather than guessed.
    (Our YAML loader reads ``1e-5`` as a float, so that needs no coercion.)
    """

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    def model_copy(self: M, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> M:
        """A copy; with ``update``, the fields the user gave plus ``update``, validated again.

        Unlike pydantic's own ``model_copy``, nothing is skipped: the changed
        values are checked, and the values derived from them are derived again.
        """
        if not update:
            return super().model_copy(deep=deep)
        return type(self).model_validate({**self.model_dump(exclude_unset=True), **update})


def fill_derived(model: BaseModel, **values: Any) -> None:
    """Set ``values`` on ``model`` (inside its own validator) as derived from other fields.

    Derived values are not among the fields the user gave (``model_fields_set``),
    so :meth:`StrictModel.model_copy` with an update derives them again.
    """
    for name, value in values.items():
        object.__setattr__(model, name, value)


def derived(model: M, **values: Any) -> M:
    """A copy of ``model`` with ``values`` filled in as derived (see :func:`fill_derived`)."""
    copy = BaseModel.model_copy(model)
    fill_derived(copy, **values)
    return copy


def _add_section_pattern(schema: dict[str, Any]) -> None:
    # Advertise the open-ended ``*_cfg`` keys so the JSON schema matches what loads.
    schema.setdefault("patternProperties", {})[f"^.+{SECTION_SUFFIX}$"] = {"type": "object"}


class SectionsModel(StrictModel):
    """A section that also accepts undeclared ``*_cfg`` backend sub-sections."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=_add_section_pattern)

    backend_sections: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description=(
            "Backend-specific sub-sections, keyed by their original name (e.g. 'vllm_cfg'). "
            "Written in YAML as sibling keys ending in '_cfg'; collected here and validated by the "
            "owning backend's config class. An empty value (null) means an empty section."
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _collect_backend_sections(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        declared = set(cls.model_fields)
        extra = {
            k: v for k, v in data.items() if isinstance(k, str) and k.endswith(SECTION_SUFFIX) and k not in declared
        }
        if not extra:
            return data
        rest = {k: v for k, v in data.items() if k not in extra}
        sections = dict(rest.get(SECTIONS_FIELD) or {})
        sections.update({k: ({} if v is None else v) for k, v in extra.items()})
        rest[SECTIONS_FIELD] = sections
        return rest

    @model_serializer(mode="wrap")
    def _inline_backend_sections(self, handler: Any) -> Any:
        data = handler(self)
        if isinstance(data, dict):
            sections = data.pop(SECTIONS_FIELD, None) or {}
            data.update(sections)
        return data
