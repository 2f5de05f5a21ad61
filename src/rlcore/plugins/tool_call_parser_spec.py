"""``ToolCallParserSpec``: what a plugin declares about one tool-call parser, without importing it."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rlcore.plugins.spec import import_object, module_exists
from rlcore.plugins.spec_refusals import KeptWhenRefused


class ToolCallParserSpec(KeptWhenRefused, BaseModel):
    """A parser that finds tool calls in an assistant completion (``rlcore.chat.tool_calls.ToolCallParser``).

    Selected by name, e.g. ``get_tool_call_parser("hermes")``. ``parser_class`` is built with no arguments
    where it is used; the module implementing the hook stays light (only names).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(description="The parser's name, e.g. 'hermes'.")
    parser_class: str = Field(description="'module:Class' of the parser, built with no arguments.")
    requires: tuple[str, ...] = Field(default=(), description="Top-level modules the parser needs.")
    install_hint: str = Field(default="", description="How to install what 'requires' names.")
    description: str = ""

    @field_validator("name")
    @classmethod
    def _name_is_simple(cls, v: str) -> str:
        if not v or not v.replace("_", "").replace("-", "").replace(".", "").isalnum():
            raise ValueError(f"tool-call parser name must be alphanumeric with '-', '_' or '.', got {v!r}")
        return v

    @field_validator("parser_class")
    @classmethod
    def _is_import_path(cls, v: str) -> str:
        if v.count(":") != 1 or v.startswith(":") or v.endswith(":"):
            raise ValueError(f"expected 'module:Class', got {v!r}")
        return v

    @property
    def kind(self) -> str:
        return "tool_call_parser"

    def missing_requirements(self) -> list[str]:
        """Required modules that are not installed (checked without importing them)."""
        return [module for module in self.requires if not module_exists(module)]

    def class_module_exists(self) -> bool:
        """Whether the parser's module is installed (checked without importing it)."""
        return module_exists(self.parser_class.partition(":")[0])

    def load_parser_class(self) -> type:
        parser_class = import_object(self.parser_class)
        if not isinstance(parser_class, type):
            raise TypeError(f"tool-call parser '{self.name}': {self.parser_class} is not a class")
        return parser_class
