"""scripts/count_annotations.py counts what it says, on a source whose counts are known by hand."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "count_annotations.py"

SOURCE = """
from typing import Any
import typing

def f(a, b: int, c: Any, /, d: "Any", *args: Any, e: typing.Any = 1, **kwargs: object) -> Any: ...

class C:
    def m(self, x: dict[str, Any], y: Any | None) -> None: ...

    @classmethod
    def k(cls, z: list[int]) -> None: ...

g = lambda q: q
"""


def _script():
    spec = importlib.util.spec_from_file_location("count_annotations", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)  # its dataclass looks its module up there
    spec.loader.exec_module(sys.modules[spec.name])
    return sys.modules[spec.name]


def test_counts_named_parameters_and_bare_any_like_issue_51():
    counts = _script().count_source(SOURCE)
    # named: a b c d e | x y | z (self, cls, *args, **kwargs and the lambda's q are not counted)
    assert counts.parameters == 8
    assert counts.annotated == 7  # all but a
    assert counts.bare_any == 3  # c, "Any", typing.Any
    assert counts.mentions_any == 5  # those, dict[str, Any], Any | None
    assert (counts.star_parameters, counts.star_any) == (2, 1)  # *args: Any, **kwargs: object


def test_the_command_prints_the_totals(tmp_path, capsys):
    (tmp_path / "m.py").write_text(SOURCE)
    assert _script().main([str(tmp_path)]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == "parameters: 8 (annotated 7), typed Any: 3 (37.5%)"
