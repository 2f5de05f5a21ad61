"""A dataset row as a sample: its message log (system prompt, user prompt) and its metadata.

The metadata is the row's columns, with the expected answer (``data.output_key``) under ``ground_truth`` as
the environment reads it (NeMo-RL's name). A row holding ``data.messages_key`` is a message log already.
A key with dots names a field inside nested columns (``reward_model.ground_truth``: DAPO-Math-17k's answer)
when the row has no column of that exact name.

A message's content is text, or a list of parts in the Hugging Face chat-template form: ``{"type": "text",
"text": ...}`` and ``{"type": "image"}``, the latter with its image under ``"image"`` or, without one, taking the
next image of the row's ``data.image_key`` column. With no such image part, the column's images go before the
text of the first user message. The sample holds the images decoded (:mod:`.images`), in the order its messages
refer to them, and each image part of its messages as a bare ``{"type": "image"}``.
"""

from __future__ import annotations

import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlcore.datasets.files import DataError, special_file_kind
from rlcore.interfaces.environment import Message

if TYPE_CHECKING:
    from PIL import Image

_ROLES = ("system", "user", "assistant", "environment", "tool")
_MISSING = object()


def _field(row: dict[str, Any], key: str) -> Any:
    """``row[key]``; else, for a dotted key, the nested field it names; else ``_MISSING``."""
    if key in row:
        return row[key]
    if "." not in key:
        return _MISSING
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


@dataclass(frozen=True)
class Sample:
    """One prompt of a run: ``idx`` is its row's position in its dataset (or the generator's count); ``images``
    are the pictures its messages' image parts show, in the order the parts come."""

    idx: int
    messages: list[Message]
    metadata: dict[str, Any]
    images: list[Image.Image] = field(default_factory=list)


def _read_setting(path: str, setting: str) -> str:
    try:
        if (kind := special_file_kind(Path(path))) is not None:
            raise DataError(f"data.{setting}: {path} is {kind}, not a regular file; give a text file")
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"data.{setting}: cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None


def _positional_fields(template: str) -> int:
    """How many ``{}`` / ``{N}`` fields ``template`` has (named ones, ``{problem}``, are the row's columns)."""
    fields = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    return sum(1 for name in fields if name == "" or name.split(".")[0].split("[")[0].isdigit())


def template_problem(data_cfg: Any) -> str | None:
    """What is wrong with the prompt template ``data`` names (``prompt_template``, or the text of ``prompt_file``)
    that no row is needed to see: not a format string, or more ``{}`` fields than the one a prompt fills (a
    single-brace ``\\boxed{}``). None when it is fine, or when there is none. ``rlcore config validate`` asks
    this; a run finds the same when it reads its rows."""
    template = data_cfg.prompt_template
    if data_cfg.prompt_file is not None:
        try:
            template = Path(data_cfg.prompt_file).expanduser().read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            return None  # the file checks say why it cannot be read
    if template is None:
        return None
    try:
        count = _positional_fields(template)
    except ValueError as exc:
        return _not_a_format_string(data_cfg, exc)
    return _too_many_fields(data_cfg, count) if count > 1 else None


def _template_setting(data_cfg: Any) -> str:
    """How a line names the template: ``prompt_file (<path>)`` or ``prompt_template``."""
    return f"prompt_file ({data_cfg.prompt_file})" if data_cfg.prompt_file else "prompt_template"


def _too_many_fields(data_cfg: Any, count: int) -> str:
    return (
        f"data.{_template_setting(data_cfg)}: has {count} '{{}}' fields, but a prompt fills only the first (with "
        f"the row's '{data_cfg.input_key}'); write literal braces as '{{{{}}}}'"
    )


def _not_a_format_string(data_cfg: Any, exc: ValueError) -> str:
    return f"data.{_template_setting(data_cfg)}: not a format string ({exc}); write literal braces as '{{{{' and '}}}}'"


class SampleBuilder:
    """Turns rows into samples as ``data`` says (keys, system prompt, prompt template)."""

    def __init__(self, data_cfg: Any) -> None:
        self.cfg = data_cfg
        self.system = data_cfg.system_prompt
        if data_cfg.system_prompt_file is not None:
            self.system = _read_setting(data_cfg.system_prompt_file, "system_prompt_file")
        self.template = data_cfg.prompt_template
        if data_cfg.prompt_file is not None:
            self.template = _read_setting(data_cfg.prompt_file, "prompt_file")

    def sample(self, row: dict[str, Any], idx: int, where: str, base_dir: Path | None = None) -> Sample:
        """The sample of ``row``; ``where`` names the row in errors ('train.jsonl: row 7'); ``base_dir``: what
        an image's relative path is relative to (the data file's directory)."""
        cfg = self.cfg
        if (log := _field(row, cfg.messages_key)) is not _MISSING:
            messages = self._messages(log, where)
        else:
            if (prompt := _field(row, cfg.input_key)) is _MISSING:
                raise DataError(
                    f"{where}: no field '{cfg.input_key}' (data.input_key); the row has "
                    f"{', '.join(map(str, row)) or 'no fields'}"
                )
            messages = [{"role": "user", "content": self._prompt(row, prompt, where)}]
        messages, sources = self._image_sources(messages, self._column_images(row, where), where)
        if self.system is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.system}, *messages]
        dropped = {cfg.messages_key, cfg.image_key}  # the images are the sample's own, decoded
        metadata = {key: value for key, value in row.items() if key not in dropped}
        if (answer := _field(row, cfg.output_key)) is not _MISSING:
            metadata["ground_truth"] = answer
        if not sources:
            return Sample(idx, messages, metadata)
        from rlcore.datasets.images import decode_image

        return Sample(idx, messages, metadata, [decode_image(src, where, what, base_dir) for src, what in sources])

    def _column_images(self, row: dict[str, Any], where: str) -> list[tuple[object, str]]:
        """The images of the row's ``data.image_key`` column (a list, or one image; null: none), with their
        names for errors."""
        key = self.cfg.image_key
        if key is None:
            return []
        if (value := _field(row, key)) is _MISSING:
            raise DataError(
                f"{where}: no field '{key}' (data.image_key); the row has {', '.join(map(str, row)) or 'no fields'}"
                " (a row without images: give it null or [])"
            )
        if value is None:
            return []
        if isinstance(value, (list, tuple)):
            return [(item, f"column '{key}' item {k}") for k, item in enumerate(value, 1)]
        return [(value, f"column '{key}'")]

    def _image_sources(
        self, messages: list[Message], column: list[tuple[object, str]], where: str
    ) -> tuple[list[Message], list[tuple[object, str]]]:
        """``messages`` with every image part bare, and the image of each part in order: its own ``"image"``,
        else the column's next. A log with no image part gets the column's images before the text of its first
        user message."""
        out: list[Message] = []
        sources: list[tuple[object, str]] = []
        parts_seen, from_column = 0, 0
        for i, message in enumerate(messages, 1):
            content = message["content"]
            if isinstance(content, list):
                content = [dict(part) for part in content]
                for j, part in enumerate(content, 1):
                    if part["type"] != "image":
                        continue
                    parts_seen += 1
                    if "image" in part:
                        sources.append((part.pop("image"), f"field '{self.cfg.messages_key}' message {i} part {j}"))
                    elif from_column < len(column):
                        sources.append(column[from_column])
                        from_column += 1
                    else:
                        raise DataError(self._too_few_images(where, from_column + 1, len(column)))
            out.append({**message, "content": content})
        if parts_seen == 0 and column:
            return self._images_first(out, column, where), list(column)
        if 0 < from_column < len(column) or (from_column == 0 and parts_seen and column):
            raise DataError(
                f"{where}: column '{self.cfg.image_key}' (data.image_key) holds {len(column)} images, but the "
                f"messages have {from_column} image parts without an image of their own to show them; give one "
                "{'type': 'image'} part per image"
            )
        return out, sources

    def _too_few_images(self, where: str, needed: int, held: int) -> str:
        key = self.cfg.image_key
        if key is None:
            return (
                f"{where}: field '{self.cfg.messages_key}' has an image part without an image: give the part its "
                "'image', or set data.image_key to the column holding the row's images"
            )
        return (
            f"{where}: field '{self.cfg.messages_key}' has at least {needed} image parts without an image, but "
            f"column '{key}' (data.image_key) holds {held}; give each part its 'image', or the column one per part"
        )

    def _images_first(self, messages: list[Message], column: list[tuple[object, str]], where: str) -> list[Message]:
        """``messages`` with one image part per column image before the first user message's text."""
        for i, message in enumerate(messages):
            if message["role"] == "user":
                content = message["content"]
                text = [{"type": "text", "text": content}] if isinstance(content, str) else content
                images = [{"type": "image"} for _ in column]
                return [*messages[:i], {**message, "content": [*images, *text]}, *messages[i + 1 :]]
        raise DataError(
            f"{where}: column '{self.cfg.image_key}' (data.image_key) holds images, but the messages have no user "
            "message to show them in"
        )

    def _prompt(self, row: dict[str, Any], value: Any, where: str) -> str:
        if not isinstance(value, str):
            raise DataError(f"{where}: field '{self.cfg.input_key}' is {type(value).__name__}, not text")
        if self.template is None:
            return value
        try:
            return string.Formatter().vformat(self.template, (value,), {**row, "input": value})
        except IndexError:  # a second '{}' (or '{1}'): the prompt fills only the first
            raise DataError(_too_many_fields(self.cfg, _positional_fields(self.template))) from None
        except KeyError as exc:
            raise DataError(
                f"{where}: data.{_template_setting(self.cfg)} names {exc}, which the row does not have (it has "
                f"{', '.join(map(str, row))}); write a literal brace as '{{{{' or '}}}}'"
            ) from None
        except ValueError as exc:
            raise DataError(_not_a_format_string(self.cfg, exc)) from None

    def _messages(self, value: Any, where: str) -> list[Message]:
        key = self.cfg.messages_key
        if not isinstance(value, list) or not value:
            raise DataError(f"{where}: field '{key}' must be a non-empty list of {{role, content}} messages")
        messages = []
        for i, message in enumerate(value, 1):
            if not (isinstance(message, dict) and message.get("role") in _ROLES and "content" in message):
                raise DataError(
                    f"{where}: field '{key}' message {i} needs a role ({', '.join(_ROLES)}) and content (text, or "
                    "a list of text and image parts)"
                )
            content = _content(message["content"], f"{where}: field '{key}' message {i}")
            messages.append({"role": message["role"], "content": content})
        return messages


def _content(value: Any, where: str) -> str | list[dict[str, Any]]:
    """A message's content: text, or its parts (``text``, and ``image`` with its ``image`` when it has one). A
    part read from an Arrow table holds every key any part has, the others null: those are dropped."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: content must be text or a non-empty list of parts, not {type(value).__name__}")
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(value, 1):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image":
            parts.append({"type": "image", **({"image": part["image"]} if part.get("image") is not None else {})})
        else:
            raise DataError(
                f"{where} part {j}: expected {{'type': 'text', 'text': ...}} or {{'type': 'image'}} (with an "
                f"optional 'image'), got {str(part)[:80]}"
            )
    return parts
