"""One bad environment spec does not hide the other environments of its plugin (issue 44, item 4).

A plugin distribution registers three environments from one hook; the second spec has a bad field. Only that one is
``broken``, with the pydantic error and the plugin's line that made it; the two others stay ``ok`` and selectable,
in the registry, in ``rlcore environments list`` and in the checks ``rlcore run`` makes (``config validate``).
In-process, without Ray: the plugin is an installed-looking distribution on a temporary import path.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from rlcore.plugins import BackendError, EnvironmentSpec, Registry, hookimpl, set_registry

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "grpo_tiny.yaml"

PLUGIN = """\
from rlcore.interfaces.environment import EnvironmentReturn
from rlcore.plugins import EnvironmentSpec, hookimpl


class CountEnvironment:
    def __init__(self, config):
        self.config = config

    def step(self, message_logs, metadata):
        return EnvironmentReturn.final([float(len(log[-1]["content"])) for log in message_logs], metadata)


@hookimpl
def rlcore_register_environments(register):
    register(EnvironmentSpec(name="word_count", environment_class="wc_plugin:CountEnvironment"))
    register(EnvironmentSpec(name="char_count", environment_class="wc_plugin.CountEnvironment"))  # no colon
    register(EnvironmentSpec(name="line_count", environment_class="wc_plugin:CountEnvironment"))
"""
#: The line of PLUGIN that makes the char_count spec.
BAD_LINE = next(i for i, line in enumerate(PLUGIN.splitlines(), 1) if 'name="char_count"' in line)


@pytest.fixture
def plugin_registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Registry:
    """A registry of rlcore's own plugins and the installed-looking ``rl-word-count`` distribution, made the
    process-wide registry for the test."""
    site = tmp_path / "site"
    (site / "wc_plugin").mkdir(parents=True)
    (site / "wc_plugin" / "__init__.py").write_text(PLUGIN)
    info = site / "rl_word_count-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: rl-word-count\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[rlcore.plugins]\nwc_plugin = wc_plugin\n")
    monkeypatch.syspath_prepend(str(site))  # installed: its entry point is found with the others
    registry = Registry()
    registry.load_entry_points()
    set_registry(registry)
    yield registry
    set_registry(None)
    sys.modules.pop("wc_plugin", None)  # the next test's copy lives at another path


def bad_line(site_module: Path) -> str:
    return (
        f"EnvironmentSpec refused: environment_class: expected 'module:Name', got 'wc_plugin.CountEnvironment' "
        f"(at {site_module}:{BAD_LINE})"
    )


def test_only_the_bad_spec_is_broken_and_its_siblings_are_usable(plugin_registry: Registry, tmp_path: Path) -> None:
    mine = {
        r.name: (r.kind, r.status, r.problem)
        for r in plugin_registry.environments()
        if r.distribution == "rl-word-count"
    }
    module = tmp_path / "site" / "wc_plugin" / "__init__.py"
    assert mine == {
        "word_count": ("environment", "ok", ""),
        "line_count": ("environment", "ok", ""),
        "char_count": ("environment", "broken", bad_line(module)),
    }
    for name in ("word_count", "line_count", "rl-word-count:line_count"):
        assert plugin_registry.resolve_environment(name).environment_class == "wc_plugin:CountEnvironment"
    with pytest.raises(BackendError) as caught:
        plugin_registry.resolve_environment("char_count")
    assert str(caught.value) == f"environment 'char_count' is broken: {bad_line(module)}"


def test_environments_list_and_the_run_checks_say_so(plugin_registry: Registry, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from rlcore.cli.app import app

    module = tmp_path / "site" / "wc_plugin" / "__init__.py"
    listed = CliRunner().invoke(app, ["environments", "list", "--json"])
    assert listed.exit_code == 0, listed.output
    rows = {
        r["name"]: (r["status"], r["problem"])
        for r in json.loads(listed.output)["environments"]
        if r["distribution"] == "rl-word-count"
    }
    assert rows == {"word_count": ("ok", ""), "char_count": ("broken", bad_line(module)), "line_count": ("ok", "")}

    broken = CliRunner().invoke(app, ["config", "validate", str(TINY), "--no-files", "-o", "env.name=char_count"])
    assert broken.exit_code == 1
    assert f"env.name: environment 'char_count' is broken: {bad_line(module)}" in broken.output.splitlines()
    sibling = CliRunner().invoke(app, ["config", "validate", str(TINY), "--no-files", "-o", "env.name=line_count"])
    assert sibling.exit_code == 0, sibling.output


def test_a_hook_that_fails_midway_keeps_the_specs_it_registered() -> None:
    class HalfPlugin:
        @hookimpl
        def rlcore_register_environments(self, register):
            register(EnvironmentSpec(name="first", environment_class="collections:Counter"))
            raise KeyError("settings")

    registry = Registry()
    registry.register_plugin(HalfPlugin(), "half", distribution="rl-half")
    assert [(r.name, r.kind, r.status) for r in registry.records] == [
        ("first", "environment", "ok"),
        ("half", "?", "broken"),
    ]
    assert registry.records[1].problem.startswith("plugin failed to load: KeyError: 'settings' (at ")
    assert registry.resolve_environment("first").environment_class == "collections:Counter"


def test_outside_the_registry_a_bad_spec_still_raises() -> None:
    """The plugin API's promise: constructing a bad spec in a plugin's own code or tests raises, as before."""
    with pytest.raises(ValidationError, match="expected 'module:Name'"):
        EnvironmentSpec(name="char_count", environment_class="wc_plugin.CountEnvironment")
    with pytest.raises(ValidationError, match="environment name must be alphanumeric"):
        EnvironmentSpec(name="char count", environment_class="wc_plugin:CountEnvironment")


def test_a_refused_spec_does_not_shadow_the_same_name_from_another_distribution() -> None:
    class Refused:
        @hookimpl
        def rlcore_register_environments(self, register):
            register(EnvironmentSpec(name="char_count", environment_class="no colon"))

    class Good:
        @hookimpl
        def rlcore_register_environments(self, register):
            register(EnvironmentSpec(name="char_count", environment_class="collections:Counter"))

    registry = Registry()
    registry.register_plugin(Refused(), "refused", distribution="rl-refused")
    registry.register_plugin(Good(), "good", distribution="rl-good")
    assert [(r.distribution, r.status) for r in registry.environments()] == [
        ("rl-refused", "broken"),
        ("rl-good", "ok"),
    ]
    assert registry.resolve_environment("char_count").environment_class == "collections:Counter"
    with pytest.raises(
        BackendError,
        match="environment 'rl-refused:char_count' is broken: EnvironmentSpec refused: "
        "environment_class: expected 'module:Name', got 'no colon'",
    ):
        registry.resolve_environment("rl-refused:char_count")
