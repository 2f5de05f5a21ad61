"""Base classes shared by every config section.

``StrictModel`` rejects unknown keys. ``SectionsModel`` additionally lets a
section carry backend-specific sub-sections (``vllm_cfg``, ``mybackend_cfg``)
that the core does not know: any undeclared key ending in ``_cfg`` is moved
into ``backend_sections`` before validation and written back under its own
name when dumping. The plugin registry validates those sections later against
the owning backend's config class (see ``rlcore.config.validate_section``).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

SECTION_SUFFIX = "_cfg"
SECTIONS_FIELD = "backend_sections"


class StrictModel(BaseModel):
    """A config section: unknown keys are errors and values are not coerced.

    Strict typing means ``true`` is not an integer and ``"2"`` is not a
    number: a YAML value of the wrong kind is reported rather than guessed.
    (Our YAML loader reads ``1e-5`` as a float, so that needs no coercion.)
    """

    model_config = ConfigDict(extra="forbid", strict=True)


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
        extra = {k: v for k, v in data.items()
                 if isinstance(k, str) and k.endswith(SECTION_SUFFIX) and k not in declared}
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
