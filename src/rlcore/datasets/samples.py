"""A dataset row as a sample: its message log (system prompt, user prompt) and its metadata.

The metadata is the row's columns, with the expected answer (``data.output_key``) under ``ground_truth`` as
the environment reads it (NeMo-RL's name). A row holding ``data.messages_key`` is a message log already.
A key with dots names a field inside nested columns (``reward_model.ground_truth``: DAPO-Math-17k's answer)
when the row has no column of that exact name.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlcore.datasets.files import DataError, special_file_kind
from rlcore.interfaces.environment import Message

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
    """One prompt of a run: ``idx`` is its row's position in its dataset (or the generator's count)."""

    idx: int
    messages: list[Message]
    metadata: dict[str, Any]


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

    def sample(self, row: dict[str, Any], idx: int, where: str) -> Sample:
        """The sample of ``row``; ``where`` names the row in errors ('train.jsonl: row 7')."""
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
        if self.system is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.system}, *messages]
        metadata = {key: value for key, value in row.items() if key != cfg.messages_key}
        if (answer := _field(row, cfg.output_key)) is not _MISSING:
            metadata["ground_truth"] = answer
        return Sample(idx, messages, metadata)

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
        for i, message in enumerate(value):
            if not (
                isinstance(message, dict) and isinstance(message.get("content"), str) and message.get("role") in _ROLES
            ):
                raise DataError(
                    f"{where}: field '{key}' message {i + 1} needs a role ({', '.join(_ROLES)}) and text content"
                )
        return [{"role": m["role"], "content": m["content"]} for m in value]
