"""Versions mean something: a plugin that declares the ``rlcore>=`` requirement docs/plugin-api.md tells its
authors to declare is listed ``ok``, and one that asks for the next minor release is ``incompatible``.

The plugin is a distribution made to look installed (a ``*.dist-info`` beside its module on ``PYTHONPATH``);
the listings are the real ``rlcore ... list --json`` commands. No Ray, no pip.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

import rlcore

REPO = Path(__file__).resolve().parents[2]
FIRST_PARTY = sorted((REPO / "plugins").glob("rl-*/pyproject.toml"))


def documented_requirement() -> str:
    """The requirement docs/plugin-api.md tells a plugin to declare: its ``dependencies = ["rlcore>=..."]`` line."""
    found = re.findall(r'dependencies = \["(rlcore>=[0-9.]+)"\]', (REPO / "docs" / "plugin-api.md").read_text())
    assert found, "docs/plugin-api.md no longer shows the requirement a plugin declares"
    assert len(set(found)) == 1, f"docs/plugin-api.md shows several requirements: {sorted(set(found))}"
    return found[0]


def pyproject_value(path: Path, key: str) -> str:
    (value,) = re.findall(rf'^{key} = "([^"]+)"$', path.read_text(), flags=re.M)
    return value


PLUGIN = """
from rlcore.plugins import AlgorithmSpec, BackendSpec, EnvironmentSpec, hookimpl


@hookimpl
def rlcore_register_backends(register):
    register(BackendSpec(name="NAME_backend", kind="training", worker_class="collections:Counter"))


@hookimpl
def rlcore_register_environments(register):
    register(EnvironmentSpec(name="NAME_env", environment_class="collections:Counter"))


@hookimpl
def rlcore_register_algorithms(register):
    register(AlgorithmSpec(name="NAME_algo", config_class="collections:Counter", algorithm_class="collections:Counter"))
"""


def fake_distribution(site: Path, name: str, requirement: str) -> None:
    """An installed-looking distribution ``rlcore-<name>`` that requires ``requirement`` and registers a backend,
    an environment and an algorithm, each named after it."""
    module = f"rlcore_version_probe_{name}"
    (site / f"{module}.py").write_text(PLUGIN.replace("NAME", name))
    info = site / f"{module}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: rlcore-{name}\nVersion: 1.0\nRequires-Dist: {requirement}\n"
    )
    (info / "entry_points.txt").write_text(f"[rlcore.plugins]\n{name} = {module}\n")


def listed(site: Path, kind: str) -> dict[str, dict]:
    """``rlcore <kind> list --json`` with ``site`` installed: rows by name."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    for var in ("RLCORE_PLUGINS", "RLCORE_DISABLE_PLUGINS"):
        env.pop(var, None)
    out = subprocess.run(
        [sys.executable, "-m", "rlcore", kind, "list", "--json"], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return {row["name"]: row for row in json.loads(out.stdout)[kind]}


def test_rlcore_and_its_plugins_carry_one_version_that_meets_the_documented_requirement():
    version = pyproject_value(REPO / "pyproject.toml", "version")
    assert rlcore.__version__ == version
    requirement = Requirement(documented_requirement())
    assert requirement.specifier.contains(version), f"rlcore {version} does not meet its own docs' {requirement}"
    assert FIRST_PARTY, "no plugins/rl-*/pyproject.toml found"
    for pyproject in FIRST_PARTY:
        assert pyproject_value(pyproject, "version") == version, pyproject
        (line,) = re.findall(r'"(rlcore\[[^\]]*\][^"]*)"', pyproject.read_text())
        assert Requirement(line).specifier == requirement.specifier, f"{pyproject}: {line}"


def test_a_plugin_declaring_the_documented_requirement_lists_ok_and_one_needing_the_next_minor_does_not(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    fake_distribution(site, "documented", documented_requirement())
    major, minor = Version(rlcore.__version__).release[:2]
    fake_distribution(site, "future", f"rlcore>={major}.{minor + 1}")
    problem = f"requires rlcore>={major}.{minor + 1}, this is {rlcore.__version__}: upgrade rlcore"
    for kind, suffix in (("backends", "backend"), ("environments", "env"), ("algorithms", "algo")):
        rows = listed(site, kind)
        ok, future = rows[f"documented_{suffix}"], rows[f"future_{suffix}"]
        assert (ok["status"], ok["problem"], ok["distribution"]) == ("ok", "", "rlcore-documented"), kind
        assert (future["status"], future["problem"]) == ("incompatible", problem), kind


def test_every_page_asks_a_plugin_for_the_documented_requirement():
    """Each ``dependencies = ["rlcore..."]`` a page shows a plugin author is the one docs/plugin-api.md documents."""
    pages = [*(REPO / "docs").glob("*.md"), REPO / "README.md", *(REPO / "examples").glob("*/README.md")]
    shown = {
        (page.relative_to(REPO).as_posix(), requirement)
        for page in pages
        for requirement in re.findall(r'dependencies = \["(rlcore[^"]*)"', page.read_text())
    }
    assert {page for page, _ in shown} >= {"docs/plugin-api.md", "README.md", "examples/plugin-template/README.md"}
    documented = Requirement(documented_requirement()).specifier
    assert {Requirement(r).specifier for _, r in shown} == {documented}, sorted(shown)
    for example in ("plugin-template", "plugin-tp"):  # the template's own pyproject does what it teaches
        (line,) = re.findall(
            r'dependencies = \["(rlcore[^"]*)"', (REPO / "examples" / example / "pyproject.toml").read_text()
        )
        assert Requirement(line).specifier == documented, example


def test_plugin_api_version_is_taught_nowhere_but_the_change_log():
    """The retired field is still accepted (tests/plugins/test_plugin_api.py), but no page, template or
    first-party spec shows it; docs/plugin-api.md's change log says what it was."""
    files = [*(REPO / "docs").glob("*.md"), REPO / "README.md", *(REPO / "examples").rglob("*.*")]
    files += [*(REPO / "plugins").glob("rl-*/src/*/plugin.py"), REPO / "src/rlcore/backends/reference/plugin.py"]
    found = []
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        if path.name == "plugin-api.md":
            text = text.split("## Change log", 1)[0]
        found += [path.relative_to(REPO).as_posix()] if "plugin_api_version" in text else []
    assert not found, found
