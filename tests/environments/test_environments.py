"""Environments as plugins: the built-ins' scores, the contract's checks, isolation of failing samples, actors with
a timeout, and the config that selects them."""

from __future__ import annotations

import time

import pytest

from rlcore.config import ConfigError, load_config_dict, resolve
from rlcore.environments.runner import EnvironmentFailed, EnvironmentRunner, isolated_step
from rlcore.interfaces.environment import EnvironmentReturn
from rlcore.plugins import BackendError, BackendSpec, EnvironmentSpec, Registry, get_registry, hookimpl


def _logs(*completions):
    return [[{"role": "user", "content": "q"}, {"role": "assistant", "content": c}] for c in completions]


def _runner(name, section=None, **kwargs):
    spec = get_registry().resolve_environment(name)
    model = spec.load_config_class()
    return EnvironmentRunner(
        name,
        spec.environment_class,
        model(**section)
        if model and section is not None
        else (model() if model and name not in ("regex", "python") else section),
        **kwargs,
    )


def test_the_builtins_are_listed_as_environments_not_backends():
    registry = get_registry()
    names = {r.name for r in registry.environments() if r.kind == "environment"}
    assert {"digits", "math", "exact_match", "regex", "python"} <= names
    assert not {r.name for r in registry.backends()} & names
    assert isinstance(registry.resolve_environment("math"), EnvironmentSpec)
    with pytest.raises(BackendError, match="no backend named 'math'"):
        registry.resolve("math", kind="training")


def test_exact_match_and_regex_score_against_ground_truth():
    from rlcore.environments.matching import RegexConfig

    meta = [{"ground_truth": "Paris"}, {"ground_truth": "Paris"}, {"ground_truth": "7"}]
    out = _runner("exact_match").step(_logs(" Paris\n", "paris", "7"), meta)
    assert out.rewards == [1.0, 0.0, 1.0] and out.terminateds == [True] * 3
    regex = EnvironmentRunner(
        "regex", "rlcore.environments.matching:RegexEnvironment", RegexConfig(pattern=r"answer: (\d+)")
    )
    out = regex.step(_logs("answer: 3 ... answer: 7", "answer: 8", "none"), meta)
    assert out.rewards == [0.0, 0.0, 0.0] and out.answers == ["7", "8", None]
    out = regex.step(_logs("answer: 3 ... answer: 7"), [{"ground_truth": 7}])
    assert out.rewards == [1.0]


def test_math_environment_reads_the_final_answer():
    meta = [{"ground_truth": "1/2"}] * 3 + [{"ground_truth": "12"}]
    out = _runner("math").step(_logs(r"so \boxed{\frac{1}{2}}", "it is 0.5", "maybe 2", "1.2"), meta)
    assert out.rewards == [1.0, 1.0, 0.0, 0.0]


def test_python_reward_gets_metadata_when_it_asks():
    from rlcore.environments.python_reward import PythonRewardConfig

    with_meta = PythonRewardConfig(
        reward="tests.environments.test_environments:length_minus_offset", kwargs={"scale": 2.0}
    )
    out = EnvironmentRunner("python", "rlcore.environments.python_reward:PythonRewardEnvironment", with_meta).step(
        _logs("abc", "a"), [{"offset": 1}, {"offset": 0}]
    )
    assert out.rewards == [4.0, 2.0]
    legacy = PythonRewardConfig(reward="rlcore.run.tasks.toy:digit_reward")  # rlcore 0.1's signature
    out = EnvironmentRunner("python", "rlcore.environments.python_reward:PythonRewardEnvironment", legacy).step(
        _logs("12ab", ""), [{}, {}]
    )
    assert out.rewards == [0.5, 0.0]


def length_minus_offset(prompts, completions, metadata, scale):
    assert prompts == ["q"] * len(completions)
    return [scale * (len(c) - m["offset"]) for c, m in zip(completions, metadata)]


class FlakyEnvironment:
    """Raises on any batch holding 'boom'; sleeps on 'slow'."""

    def __init__(self, config=None):
        pass

    def step(self, message_logs, metadata):
        texts = [log[-1]["content"] for log in message_logs]
        if "boom" in texts:
            raise RuntimeError("verifier crashed")
        if "slow" in texts:
            time.sleep(30)
        return EnvironmentReturn.final([1.0] * len(texts), metadata)


def test_a_sample_that_crashes_the_environment_costs_that_sample_only():
    out = isolated_step(FlakyEnvironment(), _logs("a", "boom", "c"), [{}, {}, {}])
    assert out.rewards == [1.0, 0.0, 1.0]
    assert out.errors == [None, "RuntimeError: verifier crashed", None]
    runner = EnvironmentRunner("flaky", "tests.environments.test_environments:FlakyEnvironment", None)
    with pytest.raises(
        EnvironmentFailed, match="environment 'flaky': all 2 samples failed; the first: RuntimeError: verifier crashed"
    ):
        runner.step(_logs("boom", "boom"), [{}, {}])


def test_a_missing_ground_truth_is_a_clear_error_not_a_silent_zero():
    with pytest.raises(EnvironmentFailed, match="no ground_truth \\(set data.output_key"):
        _runner("math").step(_logs("1"), [{"answer": "1"}])


def test_environment_return_checks_its_lengths():
    with pytest.raises(ValueError, match="one entry per sample"):
        EnvironmentReturn([{"role": "environment", "content": ""}], [{}], [1.0, 0.0], [True, True])


def test_actors_time_out_per_share_and_are_replaced(ray_session):
    runner = EnvironmentRunner(
        "flaky", "tests.environments.test_environments:FlakyEnvironment", None, num_workers=2, timeout_s=3.0
    )
    try:
        started = time.monotonic()
        out = runner.step(_logs("a", "b", "slow", "d"), [{}] * 4)
        assert time.monotonic() - started < 20
        assert out.rewards == [1.0, 1.0, 0.0, 0.0]  # the second actor's share timed out
        assert out.errors[2] == out.errors[3] == "environment 'flaky' actor 1 timed out after 3s (env.timeout_s)"
        assert runner.step(_logs("a", "b", "c", "d"), [{}] * 4).rewards == [1.0] * 4  # the new actor works
    finally:
        runner.shutdown()


def test_env_config_is_validated_by_its_plugin():
    def problems(env):
        with pytest.raises(ConfigError) as info:
            resolve(
                load_config_dict(
                    {"env": env, "policy": {"generation": {"backend": "vllm"}}, "cluster": {"workers_per_node": 1}}
                ),
                run=True,
            )
        return info.value.problems

    assert problems({"name": "regex", "regex_cfg": {"pattern": "("}}) == [
        "env.regex_cfg.pattern: not a regular expression: missing ), unterminated subpattern at position 0"
    ]
    assert problems({"name": "mathh"})[0].startswith("env.name: no environment named 'mathh' (installed: ")
    assert problems({"name": "math", "regex_cfg": {"pattern": "x"}}) == [
        "env.regex_cfg: the environment is 'math', which reads env.math_cfg; remove it"
    ]
    assert problems({"name": "digits", "digits_cfg": {"x": 1}}) == [
        "env.digits_cfg: the 'digits' environment takes no settings; remove them"
    ]
    assert problems({"name": "math", "math_cfg": {"verifer": "builtin"}})[0].startswith("env.math_cfg.verifer")


def test_an_environment_registered_as_a_backend_is_an_environment():
    """rlcore 0.2's way, ``BackendSpec(kind="environment")`` through rlcore_register_backends, keeps working."""

    class Old:
        @hookimpl
        def rlcore_register_backends(self, register):
            register(
                BackendSpec(
                    name="old_env",
                    kind="environment",
                    worker_class="tests.environments.test_environments:PositionalEnvironment",
                    plugin_api_version=3,
                )
            )
            register(BackendSpec(name="ghost_env", kind="environment", worker_class="no_such_pkg.env:MyEnv"))

    class New:
        @hookimpl
        def rlcore_register_environments(self, register):
            register(
                EnvironmentSpec(
                    name="new_env", environment_class="tests.environments.test_environments:MutatingEnvironment"
                )
            )

    registry = Registry()
    registry.register_plugin(Old(), "old-plugin")
    registry.register_plugin(New(), "new-plugin")
    assert [(r.name, r.kind, r.status) for r in registry.environments()] == [
        ("old_env", "environment", "ok"),
        ("ghost_env", "environment", "broken"),
        ("new_env", "environment", "ok"),
    ]
    assert registry.backends() == []
    assert registry.resolve_environment("old_env") == EnvironmentSpec(
        name="old_env", environment_class="tests.environments.test_environments:PositionalEnvironment"
    )
    with pytest.raises(
        BackendError,
        match="environment 'ghost_env' is broken: environment module of no_such_pkg.env:MyEnv is not installed",
    ):
        registry.resolve_environment("ghost_env")


def test_an_environment_plugin_that_fails_to_load_says_why():
    """Not "no backend named 'word_count' ... pip install rl-word_count": its plugin is there, and broken."""
    from importlib import metadata

    bad = metadata.EntryPoint(name="word_count", value="rlcore_no_such_env_module_xyz", group="rlcore.plugins")
    registry = Registry()
    registry.load_entry_points([bad])
    with pytest.raises(BackendError) as caught:
        registry.resolve_environment("word_count")
    message = str(caught.value)
    assert message.startswith(
        "environment 'word_count' is broken: plugin failed to load: ModuleNotFoundError: No "
        "module named 'rlcore_no_such_env_module_xyz'"
    ), message
    assert "pip install" not in message
    with pytest.raises(
        BackendError,
        match=r"no environment named 'wordcount' \(installed: none\); no plugin rlcore knows of provides "
        r"'wordcount': .* \(plugins that failed to load: ",
    ):
        registry.resolve_environment("wordcount")


def test_rlcore_0_1_task_section_still_runs_as_data_and_env():
    with pytest.warns(DeprecationWarning, match="task section is now data.train.generator and env"):
        cfg = load_config_dict(
            {
                "task": {
                    "prompts": "rlcore.algorithms.toy_task:digit_prompts",
                    "reward": "rlcore.algorithms.toy_task:digit_reward",
                }
            }
        )
    assert cfg.env.name == "digits" and cfg.data.train.generator == "rlcore.environments.digits:digit_prompts"
    with pytest.warns(DeprecationWarning):
        cfg = load_config_dict({"task": {"prompts": "my.mod:prompts", "reward": "my.mod:reward", "kwargs": {"k": 1}}})
    assert (cfg.data.train.generator, cfg.data.train.generator_kwargs) == ("my.mod:prompts", {"k": 1})
    assert cfg.env.name == "python" and cfg.env.backend_sections["python_cfg"] == {
        "reward": "my.mod:reward",
        "kwargs": {"k": 1},
    }
    with pytest.raises(ConfigError, match="task: replaced by data and env, which this config also sets \\(env\\)"):
        load_config_dict({"task": {}, "env": {"name": "math"}})


# -- the environment kind's conformance kit --------------------------------------------------------------

BUILTIN_CASES = {
    "digits": (None, [("12ab", {}), ("", {}), ("7", {})]),
    "math": (
        "MathConfig",
        [(r"\boxed{1/2}", {"ground_truth": "0.5"}), ("3", {"ground_truth": "4"}), ("so 10", {"ground_truth": "10"})],
    ),
    "exact_match": ("ExactMatchConfig", [("Paris", {"ground_truth": "Paris"}), ("Rome", {"ground_truth": "Paris"})]),
    "regex": ("RegexConfig", [("x = 3", {"ground_truth": "3"}), ("x = 4", {"ground_truth": "3"})]),
    "python": ("PythonRewardConfig", [("abc", {"offset": 1}), ("a", {"offset": 0})]),
}
BUILTIN_SETTINGS = {
    "regex": {"pattern": r"(\d+)"},
    "python": {"reward": "tests.environments.test_environments:offset_length"},
}


def offset_length(prompts, completions, metadata):
    return [len(c) - m["offset"] for c, m in zip(completions, metadata)]


@pytest.mark.parametrize("name", sorted(BUILTIN_CASES))
def test_the_builtin_environments_pass_the_kit(name):
    from rlcore.testing.environment_kit import check_environment

    assert check_environment(name, BUILTIN_SETTINGS.get(name), BUILTIN_CASES[name][1]) == []


class PositionalEnvironment:
    """A planted bug: the reward depends on the sample's place in the batch."""

    def __init__(self, config=None):
        pass

    def step(self, message_logs, metadata):
        return EnvironmentReturn.final([float(i == 0) for i in range(len(message_logs))], metadata)


class MutatingEnvironment(PositionalEnvironment):
    """A planted bug: it writes into the metadata the loop keeps using."""

    def step(self, message_logs, metadata):
        for meta in metadata:
            meta["seen"] = True
        return EnvironmentReturn.final([1.0] * len(message_logs), metadata)


def test_the_kit_catches_planted_bugs():
    from rlcore.testing.environment_kit import check_environment

    cases = [("a", {}), ("b", {}), ("c", {})]
    assert check_environment("tests.environments.test_environments:PositionalEnvironment", None, cases) == [
        "a sample's reward depends on its position in the batch",
        "rewards of samples scored one by one [1.0, 1.0, 1.0] differ from the batch's [1.0, 0.0, 0.0]",
    ]
    assert check_environment("tests.environments.test_environments:MutatingEnvironment", None, cases) == [
        "step changed the message logs or metadata it was given"
    ]
    assert check_environment(
        "tests.environments.test_environments:FlakyEnvironment", None, [("boom", {}), ("b", {})]
    ) == ["step raised RuntimeError: verifier crashed"]
