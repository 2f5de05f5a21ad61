"""A typo in a plugin's config section is an error, even when the plugin's class would ignore it (issue 44, 9)."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ConfigDict

from rlcore.config import ConfigError, load_config_dict, resolve, validate_section
from rlcore.interfaces.environment import EnvironmentReturn
from rlcore.plugins import BackendSpec, EnvironmentSpec, Registry, hookimpl
from rlcore.testing.conformance.probes import CLASSES_PROBE, run_probe
from rlcore.testing.environment_kit import check_environment


class Depth(BaseModel):  # pydantic's default: unknown keys ignored
    depth: int = 1


class LaxConfig(BaseModel):
    keyword: str = "def "
    nested: Depth | None = None


class OpenConfig(BaseModel):
    model_config = ConfigDict(extra="allow")
    keyword: str = "def "


class StrictConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    keyword: str = "def "


class KeywordEnvironment:
    def __init__(self, config):
        self.keyword = config.keyword

    def step(self, message_logs, metadata):
        return EnvironmentReturn.final([float(self.keyword in log[-1]["content"]) for log in message_logs], metadata)


def test_a_key_the_class_would_ignore_is_refused_with_the_closest_name_nested_too():
    model, problems = validate_section(LaxConfig, {"keywrod": "x", "nested": {"dpeth": 2}}, "env.lax_cfg")
    assert model is None
    assert problems == [
        "env.lax_cfg.keywrod: unknown key; did you mean 'keyword'?",
        "env.lax_cfg.nested.dpeth: unknown key; did you mean 'depth'?",
    ]
    model, problems = validate_section(LaxConfig, {"keyword": "x", "nested": {"depth": 2}}, "env.lax_cfg")
    assert problems == [] and model.keyword == "x" and model.nested.depth == 2


def test_a_class_that_allows_extra_keys_keeps_them_and_a_forbidding_one_is_unchanged():
    model, problems = validate_section(OpenConfig, {"keyword": "x", "extra_thing": 3}, "env.open_cfg")
    assert problems == [] and model.model_extra == {"extra_thing": 3}
    _, problems = validate_section(StrictConfig, {"keywrod": "x"}, "env.strict_cfg")
    assert problems == ["env.strict_cfg.keywrod: unknown key; did you mean 'keyword'?"]


def _registry_with(config_class: str) -> Registry:
    class Plugin:
        @hookimpl
        def rlcore_register_environments(self, register):
            register(
                EnvironmentSpec(
                    name="keyword", environment_class=f"{__name__}:KeywordEnvironment", config_class=config_class
                )
            )

    registry = Registry()
    registry.load_entry_points()  # the installed backends, which the run needs too
    registry.register_plugin(Plugin(), "keyword-plugin")
    return registry


def test_a_run_config_with_a_typo_in_an_environment_plugin_section_fails_at_resolution():
    generation = {"generation": {"backend": "vllm"}}
    cfg = load_config_dict({"env": {"name": "keyword", "keyword_cfg": {"keywrod": "return"}}, "policy": generation})
    with pytest.raises(ConfigError) as caught:
        resolve(cfg, run=True, registry=_registry_with(f"{__name__}:LaxConfig"))
    assert "env.keyword_cfg.keywrod: unknown key; did you mean 'keyword'?" in caught.value.problems
    cfg = load_config_dict({"env": {"name": "keyword", "keyword_cfg": {"keyword": "return"}}, "policy": generation})
    assert (
        resolve(cfg, run=True, registry=_registry_with(f"{__name__}:LaxConfig")).environment.section.keyword == "return"
    )


def test_the_environment_kit_fails_a_config_class_that_ignores_unknown_keys():
    cases = [("def f(): pass", {}), ("no code", {})]
    spec = EnvironmentSpec(
        name="keyword", environment_class=f"{__name__}:KeywordEnvironment", config_class=f"{__name__}:LaxConfig"
    )
    problems = check_environment(spec, None, cases)
    assert len(problems) == 1 and "ignores unknown keys" in problems[0] and "extra='forbid'" in problems[0], problems
    strict = spec.model_copy(update={"config_class": f"{__name__}:StrictConfig"})
    assert check_environment(strict, None, cases) == []


def test_the_backend_kit_probe_fails_a_config_class_that_ignores_unknown_keys():
    def probe(config_class):
        spec = BackendSpec(
            name="lax",
            kind="training",
            worker_class="rlcore.backends.reference.worker:ReferenceWorker",
            config_class=config_class,
        )
        return run_probe(CLASSES_PROBE, spec.model_dump_json(), "torch")["config_error"]

    assert "ignores unknown keys" in probe(f"{__name__}:LaxConfig")
    assert probe(f"{__name__}:StrictConfig") is None
