"""The documentation is true of the code: the config reference is current and every command block runs.

Every fenced block of ``docs/*.md`` and ``README.md`` is looked at:

- ``bash``/``sh``/``shell`` blocks are commands. A block whose every command is cheap and safe here
  (:func:`runnable`: config validation and display, backend listings, ``--help``, the pure-Python
  benchmark) is run from the repository root and must exit 0. Any other block must say why it is not
  run, with ``<!-- not run: REASON -->`` on the line before its fence (``needs a GPU``,
  ``multi-host``, ``long (trains)``, ...); an unmarked block that cannot be run fails.
- ``console`` blocks (and untagged blocks starting with ``$ ``) are sessions: each ``$ `` command is run
  under the same rule, and the lines shown after it must appear in its output (stdout and stderr), in
  order; ``…`` in a shown line stands for any text, and a line that is only ``…`` for any lines.
- ``python`` blocks are compiled; unmarked ones are run in a fresh interpreter.
- ``toml``, ``yaml`` and ``json`` blocks must parse.

``docs/config-reference.md`` must equal what ``rlcore config reference`` generates.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
PAGES = [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md"]
MARKER = re.compile(r"^<!--\s*not run:\s*(\S.*?)\s*-->$")
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
COMMAND_LANGS = {"bash", "sh", "shell"}
TIMEOUT_S = 120

#: README blocks that cannot run here, by the start of their first line -> why.


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    marker: str | None  # the reason of a "not run" marker, or None

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"

    @property
    def first_line(self) -> str:
        return next((ln.strip() for ln in self.text.splitlines() if ln.strip()), "")

    @property
    def not_run(self) -> str | None:
        return self.marker

    @property
    def kind(self) -> str:
        if self.lang in COMMAND_LANGS:
            return "commands"
        if self.lang == "console" or (not self.lang and self.first_line.startswith("$ ")):
            return "session"
        return self.lang or "text"


def parse_blocks(page: Path) -> list[Block]:
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, fence, lang = len(match.group(1)), match.group(2), match.group(3).lower()
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][indent:] if not lines[i][:indent].strip() else lines[i].lstrip())
            i += 1
        i += 1  # the closing fence
        before = next((lines[k].strip() for k in range(start - 1, -1, -1) if lines[k].strip()), "")
        marker = MARKER.match(before)
        blocks.append(Block(page, start + 1, lang, "\n".join(body), marker.group(1) if marker else None))
    return blocks


BLOCKS = [block for page in PAGES for block in parse_blocks(page)]


def _id(block: Block) -> str:
    return block.where


def logical_lines(text: str) -> list[str]:
    """Lines with backslash continuations joined; blank lines and whole-line comments dropped."""
    out, pending = [], ""
    for raw in text.splitlines():
        line = pending + raw.strip()
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        pending = ""
        if line and not line.startswith("#"):
            out.append(line)
    return out


# --------------------------------------------------------------------------- what may run here


def runnable(command: str) -> bool:
    """Cheap, safe here, and touching nothing in the checkout: read-only rlcore commands, ``--help``."""
    try:
        argv = shlex.split(command, comments=True)
    except ValueError:
        return False
    if not argv or any(ch in command for ch in "|;&<>`$"):
        return False
    if argv[0] == "rlcore":
        words = argv[1:3]
        if "--help" in argv:
            return True
        if words[:1] in (["backends"], ["environments"]) and words[1:] in (["list"], ["show"]):
            return True
        if words[:1] == ["config"] and words[1:] in (["validate"], ["show"], ["schema"]):
            return True
        if words[:1] == ["config"] and words[1:] in (["reference"], ["nemo-rl-table"]):
            return "--write" not in argv
        return False
    if argv[0] in (".venv/bin/python", "python") and len(argv) > 1 and argv[1].startswith("benchmarks/"):
        return "--help" in argv or argv[1] == "benchmarks/packing_waste.py"
    return False


def run(command: str) -> subprocess.CompletedProcess:
    """``command`` in bash at the repository root, with this interpreter's environment first on PATH."""
    bindir = os.path.dirname(sys.executable)
    if command.startswith(".venv/bin/python "):
        command = shlex.quote(sys.executable) + command[len(".venv/bin/python") :]
    env = {**os.environ, "PATH": bindir + os.pathsep + os.environ.get("PATH", "")}
    return subprocess.run(
        ["bash", "-c", command], check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )


def _not_runnable_message(block: Block, command: str) -> str:
    return (
        f"{block.where}: `{command}` is not run by this test (not cheap or not safe here); mark the block "
        "with '<!-- not run: REASON -->' on the line before its fence, or make it runnable"
    )


# --------------------------------------------------------------------------- the blocks


COMMAND_BLOCKS = [b for b in BLOCKS if b.kind == "commands"]
SESSION_BLOCKS = [b for b in BLOCKS if b.kind == "session"]
PYTHON_BLOCKS = [b for b in BLOCKS if b.kind == "python"]
DATA_BLOCKS = [b for b in BLOCKS if b.kind in ("toml", "yaml", "yml", "json")]


@pytest.mark.parametrize("block", COMMAND_BLOCKS, ids=_id)
def test_command_block_runs_or_says_why_not(block: Block) -> None:
    if block.not_run:
        pytest.skip(f"not run: {block.not_run}")
    commands = logical_lines(block.text)
    assert commands, f"{block.where}: empty command block"
    for command in commands:
        assert runnable(command), _not_runnable_message(block, command)
    for command in commands:
        out = run(command)
        assert out.returncode == 0, (
            f"{block.where}: `{command}` exited {out.returncode}:\n{(out.stdout + out.stderr)[-3000:]}"
        )


def session(text: str) -> list[tuple[str, list[str]]]:
    """``[(command, shown output lines)]`` of a console block."""
    steps: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith("$ "):
            steps.append((line[2:].strip(), []))
        elif steps and steps[-1][0].endswith("\\"):
            steps[-1] = (steps[-1][0][:-1] + " " + line.strip(), steps[-1][1])
        elif steps:
            steps[-1][1].append(line.rstrip())
    return steps


def output_problems(shown: list[str], actual: list[str]) -> list[str]:
    """Shown lines not found, in order, in the actual output (``…`` = any text / any lines)."""
    pos = 0
    for line in shown:
        if not line.strip():
            continue
        if line.strip() == "…":
            continue
        pattern = re.compile(
            "".join(".*" if part == "…" else re.escape(part) for part in re.split("(…)", line)) + r"\Z"
        )
        for k in range(pos, len(actual)):
            if pattern.match(actual[k].rstrip()):
                pos = k + 1
                break
        else:
            return [f"shown line not in the output (in order): {line!r}"]
    return []


@pytest.mark.parametrize("block", SESSION_BLOCKS, ids=_id)
def test_console_block_output_matches(block: Block) -> None:
    if block.not_run:
        pytest.skip(f"not run: {block.not_run}")
    steps = session(block.text)
    assert steps, f"{block.where}: a console block without a '$ ' command"
    for command, _ in steps:
        assert runnable(command), _not_runnable_message(block, command)
    for command, shown in steps:
        out = run(command)
        actual = (out.stdout + out.stderr).splitlines()
        problems = output_problems(shown, actual)
        assert not problems, f"{block.where}: `{command}`: {problems[0]}\nactual output:\n" + "\n".join(actual[-40:])


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=_id)
def test_python_block_compiles_and_runs(block: Block) -> None:
    compile(block.text, block.where, "exec")
    if block.not_run:
        pytest.skip(f"compiled; not run: {block.not_run}")
    out = subprocess.run(
        [sys.executable, "-c", block.text], check=False, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert out.returncode == 0, f"{block.where}: the example failed:\n{out.stderr[-3000:]}"


@pytest.mark.parametrize("block", DATA_BLOCKS, ids=_id)
def test_data_block_parses(block: Block) -> None:
    if block.kind == "toml":
        tomllib = pytest.importorskip("tomllib")
        tomllib.loads(block.text)
    elif block.kind == "json":
        json.loads(block.text)
    else:
        yaml.safe_load(block.text)


def test_blocks_are_found_and_markers_are_used() -> None:
    """The parser sees the pages' blocks."""
    assert len(COMMAND_BLOCKS) >= 10 and SESSION_BLOCKS and PYTHON_BLOCKS
    ran = [b for b in COMMAND_BLOCKS + SESSION_BLOCKS if not b.not_run]
    assert len(ran) >= 5, "hardly any command block is run: are the markers too generous?"


def test_relative_links_point_at_files() -> None:
    problems = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)", text):
            if not (page.parent / target).is_file():
                problems.append(f"{page.relative_to(REPO)}: link to missing {target}")
    assert not problems, "\n".join(problems)


# --------------------------------------------------------------------------- the config reference


def test_config_reference_is_current() -> None:
    from rlcore.config.reference import OUTPUT_PATH, REGENERATE, reference_markdown

    committed = (REPO / OUTPUT_PATH).read_text(encoding="utf-8")
    generated = reference_markdown()
    if committed != generated:
        old, new = committed.splitlines(), generated.splitlines()
        first = next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))
        pytest.fail(
            f"{OUTPUT_PATH} is stale: run `{REGENERATE}` from the repository root "
            f"(first difference at line {first + 1}:\n  committed: {old[first] if first < len(old) else '<end>'}"
            f"\n  generated: {new[first] if first < len(new) else '<end>'})",
            pytrace=False,
        )


def test_reference_is_deterministic_and_covers_every_field() -> None:
    from pydantic import BaseModel

    from rlcore.config.base import SECTIONS_FIELD
    from rlcore.config.reference import reference_markdown, sections

    text = reference_markdown()
    assert text == reference_markdown()
    for section in sections():
        assert issubclass(section.model, BaseModel)
        for name in section.model.model_fields:
            if name != SECTIONS_FIELD:
                path = f"{section.path}.{name}" if section.path else name
                assert f"| `{path}` |" in text, f"{path} is missing from the reference"


def _read_names(package_dir: Path) -> set[str]:
    """Attribute and string-key names loaded anywhere under ``package_dir``
    (as tests/config/test_config_fields_read.py)."""
    names: set[str] = set()
    for path in package_dir.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                names.add(node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names.add(node.value)
    return names


def test_fields_said_to_be_read_by_one_backend_are_read_there() -> None:
    """A 'read by: <backend>' row names a field that backend's package loads (by name: a floor, not a proof)."""
    from rlcore.config.base import SECTIONS_FIELD
    from rlcore.config.reference import field_readers, installed_backends, sections

    backends = installed_backends()
    packages = {}
    for b in backends:
        spec = importlib.util.find_spec(b.worker_class.partition(":")[0].split(".")[0])
        packages[b.name] = Path(next(iter(spec.submodule_search_locations)))
    names = {name: _read_names(path) for name, path in packages.items()}
    problems = []
    for section in sections(backends):
        for field in section.model.model_fields:
            if field == SECTIONS_FIELD:
                continue
            reader = field_readers(section, field, backends)
            if reader in names and field not in names[reader]:
                problems.append(f"{section.path}.{field}: said to be read by {reader}, which never loads '{field}'")
    assert not problems, "\n".join(problems)


def test_reference_command_prints_and_writes(tmp_path, monkeypatch) -> None:
    from typer.testing import CliRunner

    from rlcore.cli.config_cmd import config_app
    from rlcore.config.reference import OUTPUT_PATH, reference_markdown

    runner = CliRunner()
    printed = runner.invoke(config_app, ["reference"])
    assert printed.exit_code == 0 and printed.stdout == reference_markdown()
    monkeypatch.chdir(tmp_path)
    refused = runner.invoke(config_app, ["reference", "--write"])
    assert refused.exit_code == 1 and "run it from the repository root" in refused.output
    (tmp_path / "docs").mkdir()
    wrote = runner.invoke(config_app, ["reference", "--write"])
    assert wrote.exit_code == 0, wrote.output
    assert (tmp_path / OUTPUT_PATH).read_text(encoding="utf-8") == reference_markdown()
