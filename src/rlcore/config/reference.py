"""The config reference (``docs/config-reference.md``), generated from the schemas.

One Markdown table per config section: every field's dotted path, type,
default, who reads it, and its description. The walk starts at
``RLCoreConfig`` and follows every nested model (optional, in lists, in unions);
each installed backend's own section (``policy.<name>_cfg``,
``policy.generation.<name>_cfg``) is added from its ``BackendSpec.config_class``,
which is imported (a light module by contract); worker classes never are.

The output depends only on the schemas and on the installed plugin
distributions, never on time or dict order: ``rlcore config reference --write``
writes it, and ``tests/project/test_docs.py`` fails when the committed file differs.
"""

from __future__ import annotations

import enum
import inspect
import json
import re
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from rlcore.config.base import SECTION_SUFFIX, SECTIONS_FIELD, SectionsModel

#: Who reads a part of the config, by dotted path; the longest matching prefix wins. ``[*]`` stands
#: for a list entry. ``{cap:NAME}`` expands to the installed backends declaring capability NAME,
#: ``{kind:KIND}`` to the installed backends of that kind.
#: Declared ``<backend>_cfg`` sections of an installed backend are read by that backend (added by the walk).
READERS: dict[str, str] = {
    "cluster": "rlcore",
    "policy": "training backends",
    "policy.backend": "rlcore",
    "policy.tokenizer": "rlcore run",
    "policy.train_global_batch_size": "rlcore, training backends",
    "policy.train_micro_batch_size": "rlcore, training backends",
    "policy.max_total_sequence_length": "rlcore, rlcore run",
    "policy.generation": "generation backend",
    "policy.generation.backend": "rlcore run",
    "policy.generation.colocated": "rlcore run",
    "policy.generation.engine_restarts_per_step": "rlcore run",
    "policy.generation.verify_refit": "rlcore run",
    "policy.generation.temperature": "generation backend, training backends",
    "policy.generation.model_name": "{kind:generation}",
    "policy.generation_batch_size": "fsdp1",
    "policy.optimizer": "training backends (megatron: `policy.megatron_cfg.optimizer`)",
    "policy.scheduler": "training backends (megatron: `policy.megatron_cfg.scheduler`)",
    "policy.dynamic_batching": "rlcore; {cap:dynamic_batching}",
    "policy.sequence_packing": "rlcore; {cap:sequence_packing}",
    "grpo": "rlcore run",
    "loss": "rlcore run",
    "task": "rlcore run",
    "logger": "rlcore run",
    "checkpointing": "rlcore run",
}

#: What the reader names in :data:`READERS` mean (printed at the top of the reference).
READER_TERMS: tuple[tuple[str, str], ...] = (
    ("rlcore", "the core on the driver: config loading and rules, the Ray cluster, the `Policy` facade"),
    ("rlcore run", "the GRPO loop of `rlcore run` (prompts, rewards, the loss, logging, checkpoints)"),
    ("training backends", "every training backend's workers (each receives the whole `policy` section)"),
    (
        "generation backend",
        (
            "the backend `policy.generation.backend` names (an engine such as vllm, or a "
            "training backend that generates, such as fsdp1)"
        ),
    ),
    ("a backend name", "only that backend"),
)

OUTPUT_PATH = "docs/config-reference.md"
REGENERATE = "rlcore config reference --write"


@dataclass(frozen=True)
class BackendInfo:
    """What the reference needs of one installed backend (from its spec; nothing is imported)."""

    name: str
    kind: str
    distribution: str
    capabilities: frozenset[str]
    config_class: str | None
    worker_class: str


@dataclass(frozen=True)
class Section:
    """One table: a model at a dotted path."""

    path: str
    model: type[BaseModel]
    readers: str  # who reads its fields unless READERS says otherwise
    note: str = ""
    variant: str = ""  # for one model of a union (e.g. a scheduler entry kind)

    @property
    def title(self) -> str:
        return f"{self.path} ({self.variant})" if self.variant else self.path

    @property
    def anchor(self) -> str:
        return re.sub(r"[^a-z0-9]+", "-", self.title.lower()).strip("-") or "top-level"

    @property
    def heading(self) -> str:
        return f"`{self.title}`" if self.path else "Top level"


# --------------------------------------------------------------------------- backends


def installed_backends(registry: Any = None) -> list[BackendInfo]:
    """Training and generation backends whose plugin registered a spec (any status but broken/disabled), sorted
    by name.

    ``registry`` defaults to a fresh one built from the installed entry points, so that a
    registry a caller swapped in (tests) does not leak into the reference.
    """
    if registry is None:
        from rlcore.plugins import Registry

        registry = Registry()
        registry.load_entry_points()
    out = {}
    for record in registry.backends():  # training and generation backends: environments and algorithms are not
        spec = record.spec
        if spec is not None and spec.name not in out:
            out[spec.name] = BackendInfo(
                spec.name,
                spec.kind,
                record.distribution,
                frozenset(spec.capabilities),
                spec.config_class,
                spec.worker_class,
            )
    return [out[name] for name in sorted(out)]


def _expand(readers: str, backends: list[BackendInfo]) -> str:
    def names(match: re.Match[str]) -> str:
        what, value = match.groups()
        found = [b.name for b in backends if (value in b.capabilities if what == "cap" else b.kind == value)]
        return ", ".join(found) if found else "no installed backend"

    return re.sub(r"\{(cap|kind):(\w+)\}", names, readers)


def readers_of(path: str, default: str, backends: list[BackendInfo], within: str = "") -> str:
    """Readers of ``path``: the longest :data:`READERS` key that is a prefix of it and longer than
    ``within`` (the enclosing section, whose readers are ``default``), else ``default``."""
    parts = path.replace("[*]", "").split(".")
    floor = len(within.replace("[*]", "").split(".")) if within else 0
    for end in range(len(parts), floor, -1):
        key = ".".join(parts[:end])
        if key in READERS:
            return _expand(READERS[key], backends)
    return _expand(default, backends)


# --------------------------------------------------------------------------- the walk


def _models_in(tp: Any) -> Iterator[tuple[type[BaseModel], bool]]:
    """``(model, in_list)`` for every model class inside an annotation."""
    origin = typing.get_origin(tp)
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        yield tp, False
        return
    in_list = origin in (list, tuple, set, frozenset)
    for arg in typing.get_args(tp):
        for model, nested in _models_in(arg):
            yield model, nested or in_list


def _root_kind(model: type[BaseModel]) -> str | None:
    """Which kind of backend owns the ``*_cfg`` sub-sections of a ``SectionsModel``."""
    from rlcore.config.generation import GenerationConfig
    from rlcore.config.policy import PolicyConfig

    if issubclass(model, PolicyConfig):
        return "training"
    if issubclass(model, GenerationConfig):
        return "generation"
    return None


def sections(backends: list[BackendInfo] | None = None) -> list[Section]:
    """Every section of the config, depth first in declaration order; backend sections after their parent's."""
    from rlcore.config.schemas import RLCoreConfig
    from rlcore.plugins import import_object

    backends = installed_backends() if backends is None else backends
    by_name = {b.name: b for b in backends}
    out: list[Section] = []

    def visit(section: Section) -> None:
        out.append(section)
        model = section.model
        for name, field in model.model_fields.items():
            if name == SECTIONS_FIELD:
                continue
            found = list(_models_in(field.annotation))
            for sub, in_list in found:
                path = f"{section.path}.{name}{'[*]' if in_list else ''}" if section.path else name
                readers = readers_of(path, section.readers, backends, section.path)
                note = ""
                owner = by_name.get(name[: -len(SECTION_SUFFIX)]) if name.endswith(SECTION_SUFFIX) else None
                if owner is not None:
                    readers = owner.name
                    if owner.config_class and import_object(owner.config_class) is sub:
                        note = f"The config class of backend `{owner.name}` (`{owner.config_class}`)."
                variant = sub.__name__ if len(found) > 1 else ""
                visit(Section(path, sub, readers, note, variant))
        kind = _root_kind(model) if issubclass(model, SectionsModel) else None
        for backend in backends:
            key = f"{backend.name}{SECTION_SUFFIX}"
            if backend.kind != kind or not backend.config_class or key in model.model_fields:
                continue
            visit(
                Section(
                    f"{section.path}.{key}",
                    import_object(backend.config_class),
                    backend.name,
                    f"Backend `{backend.name}` (distribution `{backend.distribution}`), validated with "
                    f"its config class `{backend.config_class}` when the config is resolved.",
                )
            )

    visit(Section("", RLCoreConfig, ""))
    for name, distribution, config_class in installed_algorithms():
        visit(
            Section(
                name,
                import_object(config_class),
                "rlcore run",
                f"Algorithm `{name}` (distribution `{distribution}`): a config with this top-level section "
                f"trains it; validated with its config class `{config_class}`.",
            )
        )
    for key, name, config_class in owned_sections():
        visit(
            Section(
                key,
                import_object(config_class),
                "rlcore run",
                f"A section algorithm `{name}` owns (its spec's `sections`); validated with `{config_class}`, "
                "its defaults when the config leaves it out.",
            )
        )
    return out


def installed_algorithms(registry: Any = None) -> list[tuple[str, str, str]]:
    """``(name, distribution, config class)`` of every registered algorithm, sorted by name (a fresh registry
    by default, as :func:`installed_backends`)."""
    if registry is None:
        from rlcore.plugins import Registry

        registry = Registry()
        registry.load_entry_points()
    found = {
        r.spec.name: (r.spec.name, r.distribution, r.spec.config_class)
        for r in getattr(registry, "algorithms", lambda: [])()
        if r.spec is not None
    }
    return [found[name] for name in sorted(found)]


def owned_sections(registry: Any = None) -> list[tuple[str, str, str]]:
    """``(key, algorithm, config class)`` of every top-level section an algorithm owns besides its own (its spec's
    ``sections``), sorted by key; a fresh registry by default, as :func:`installed_algorithms`."""
    if registry is None:
        from rlcore.plugins import Registry

        registry = Registry()
        registry.load_entry_points()
    found: dict[str, tuple[str, str, str]] = {}
    for r in sorted(getattr(registry, "algorithms", lambda: [])(), key=lambda r: r.name):
        for key, config_class in (r.spec.sections if r.spec is not None else {}).items():
            found.setdefault(key, (key, r.spec.name, config_class))
    return [found[key] for key in sorted(found)]


# --------------------------------------------------------------------------- rendering


def _bounds(constraints: list[Any]) -> str:
    low = high = ""
    for c in constraints:
        if isinstance(c, FieldInfo):
            return _bounds(list(c.metadata))
        if isinstance(c, annotated_types.Gt):
            low = f"> {c.gt}"
        elif isinstance(c, annotated_types.Ge):
            low = f"≥ {c.ge}"
        elif isinstance(c, annotated_types.Lt):
            high = f"< {c.lt}"
        elif isinstance(c, annotated_types.Le):
            high = f"≤ {c.le}"
    if low and high:
        return f" in {'(' if low[0] == '>' else '['}{low[2:]}, {high[2:]}{')' if high[0] == '<' else ']'}"
    return f" {low or high}" if low or high else ""


def _literal(value: Any) -> str:
    return json.dumps(value.value if isinstance(value, enum.Enum) else value)


def render_type(tp: Any, constraints: list[Any] | None = None, links: dict[type, str] | None = None) -> str:
    """A readable type: ``int > 0``, ``"PACK" | "SPREAD"``, ``float | null``, ``list[int]``, a section link."""
    constraints = constraints or []
    links = links or {}
    origin = typing.get_origin(tp)
    if tp is type(None):
        return "null"
    if tp is Any:
        return "any"
    if origin is typing.Annotated:
        base, *extra = typing.get_args(tp)
        return render_type(base, [*constraints, *extra], links)
    if origin is typing.Union or origin is types.UnionType:
        args = typing.get_args(tp)
        parts = [render_type(a, constraints, links) for a in args if a is not type(None)]
        parts = list(dict.fromkeys(parts))
        if type(None) in args:
            parts.append("null")
        return " | ".join(parts)
    if origin is typing.Literal:
        return " | ".join(_literal(v) for v in typing.get_args(tp))
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return " | ".join(_literal(v) for v in tp)
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return f"section {links[tp]}" if tp in links else f"section `{tp.__name__}`"
    if origin in (list, tuple, set, frozenset):
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        inner = ", ".join(render_type(a, None, links) for a in args) or "any"
        return f"list[{inner}]"
    if origin is dict:
        return "mapping"
    if tp is dict:
        return "mapping"
    name = getattr(tp, "__name__", str(tp))
    return f"{name}{_bounds(constraints)}"


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return "(section)"
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, (frozenset, set, tuple)):
        value = sorted(value) if isinstance(value, (frozenset, set)) else list(value)
    return f"`{json.dumps(value)}`"


def _markdown(text: str) -> str:
    """reST literals and roles (``x``, :class:`x`) as Markdown code."""
    return re.sub(r":\w+:`([^`]+)`", r"`\1`", text).replace("``", "`")


def _text(text: str) -> str:
    """One table cell: Markdown, one line, pipes escaped."""
    text = _markdown(text)
    text = " ".join(text.split())
    return text.replace("|", "\\|")


def _doc(model: type[BaseModel]) -> str:
    doc = model.__dict__.get("__doc__")
    if not doc:
        return ""
    first = inspect.cleandoc(doc).split("\n\n", 1)[0]
    return " ".join(_markdown(first).split())


def _cell_code(text: str) -> str:
    return "`" + text.replace("|", "\\|") + "`"


def field_readers(section: Section, name: str, backends: list[BackendInfo]) -> str:
    """Who reads field ``name`` of ``section`` (the *read by* column)."""
    from rlcore.config.policy import ONLY_READ_BY

    path = f"{section.path}.{name}" if section.path else name
    owner = name[: -len(SECTION_SUFFIX)] if name.endswith(SECTION_SUFFIX) else None
    if owner in {b.name for b in backends}:
        return owner  # a declared section named after a backend
    extra = section.model.model_fields[name].json_schema_extra
    if isinstance(extra, dict) and ONLY_READ_BY in extra:
        return f"{extra[ONLY_READ_BY]} (other backends refuse it)"
    if name == "enabled" and section.path == f"policy.{section.readers}{SECTION_SUFFIX}":
        return "rlcore (selects the training backend, see `policy.backend`)"
    return readers_of(path, section.readers, backends, section.path)


def render_section(section: Section, index: dict[str, list[Section]], backends: list[BackendInfo]) -> str:
    """One section: anchor, heading, what it is, and a row per field."""
    lines = [f'<a id="{section.anchor}"></a>', "", f"## {section.heading}", ""]
    about = [f"Model: `{section.model.__name__}`."]
    if doc := _doc(section.model):
        about.append(doc)
    if section.note:
        about.append(section.note)
    config = section.model.model_config
    if not config.get("strict"):
        about.append('Not strict: a value of another type is converted where pydantic can (`"0.5"` → `0.5`).')
    if config.get("extra") != "forbid":
        about.append("Unknown keys are not rejected here.")
    if issubclass(section.model, SectionsModel):
        about.append(
            "Also takes backend sub-sections: any key ending in `_cfg` (`<backend>_cfg`), checked by "
            "that backend's config class when the config is resolved (the section of a backend that is "
            "not installed is accepted only if it says `enabled: false`)."
        )
    lines += [" ".join(about), ""]
    lines += ["| key | type | default | read by | description |", "| --- | --- | --- | --- | --- |"]
    for name, field in section.model.model_fields.items():
        if name == SECTIONS_FIELD:
            continue
        path = f"{section.path}.{name}" if section.path else name
        links = {}
        for sub, in_list in _models_in(field.annotation):
            for target in index.get(f"{path}{'[*]' if in_list else ''}", []):
                if target.model is sub:
                    links[sub] = f"[`{target.title}`](#{target.anchor})"
        kind = render_type(field.annotation, list(field.metadata), links)
        kind_cell = kind.replace("|", "\\|") if links else _cell_code(kind)
        readers = field_readers(section, name, backends)
        lines.append(
            f"| `{path}` | {kind_cell} | {_default(field)} | {_text(readers)} | {_text(field.description or '')} |"
        )
    return "\n".join(lines) + "\n"


def reference_markdown(backends: list[BackendInfo] | None = None) -> str:
    """The whole reference page (deterministic for a given set of installed backends)."""
    backends = installed_backends() if backends is None else backends
    found = sections(backends)
    index: dict[str, list[Section]] = {}
    for s in found:
        index.setdefault(s.path, []).append(s)
    dists = sorted({b.distribution for b in backends})
    head = [
        "# Config reference",
        "",
        f"<!-- Generated by `{REGENERATE}` from the pydantic schemas (src/rlcore/config/reference.py);",
        "     tests/project/test_docs.py fails when this file is stale. Do not edit by hand. -->",
        "",
        (
            "Every key an rlcore config accepts, one table per section, in the order of the schema. A config is "
            "YAML plus dotted overrides (`-o policy.train_micro_batch_size=2`); `rlcore config validate FILE` checks "
            "one and `rlcore config show FILE` prints it with every default filled in. Unknown keys are errors, and "
            'values are not coerced (`"2"` is not a number, `true` is not an integer) unless a section says '
            "otherwise. A default written `null` that the description says is *resolved at load* is filled in from "
            "another key when the config is loaded."
        ),
        "",
        (
            f"Backend sections come from the plugins installed when this page was generated: "
            f"{', '.join(f'`{d}`' for d in dists)} (backends: {', '.join(f'`{b.name}`' for b in backends)}). "
            "`rlcore config reference` prints the same page for the plugins installed where it runs."
        ),
        "",
        "**read by** names who uses a key:",
        "",
        *(f"- **{term}**: {meaning}" for term, meaning in READER_TERMS),
        "",
        "## Sections",
        "",
        *(f"- [{s.heading}](#{s.anchor})" for s in found),
        "",
    ]
    body = [render_section(s, index, backends) for s in found]
    return "\n".join(head) + "\n" + "\n".join(body)


__all__ = [
    "OUTPUT_PATH",
    "READERS",
    "REGENERATE",
    "BackendInfo",
    "Section",
    "field_readers",
    "installed_backends",
    "readers_of",
    "reference_markdown",
    "render_type",
    "sections",
]
