"""The ``tools`` environment over scripted completions (no engine): tool calls run in the sandbox and come back as
tool messages, malformed or invalid calls are answered and flagged, a turn without a call is graded and ends the
episode; its config is refused with the dotted path; EnvironmentReturn's new fields join like the others."""

from __future__ import annotations

import json

import pytest

from rlcore.environments.tools import ToolsEnvironment
from rlcore.environments.tools_config import ToolsConfig
from rlcore.interfaces.environment import EnvironmentReturn


def call(name: str, **arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def logs(*completions: str) -> list[list[dict]]:
    return [[{"role": "user", "content": "compute 347*589"}, {"role": "assistant", "content": c}] for c in completions]


@pytest.fixture(scope="module")
def env() -> ToolsEnvironment:
    return ToolsEnvironment(
        ToolsConfig(
            tools=["calculator", "tests.tools.sandboxed:add", "tests.tools.sandboxed:fail"],
            max_tool_calls_per_turn=2,
            verifier="builtin",
            timeout_s=5,
        )
    )


def test_a_turn_runs_its_calls_or_answers_why_not_and_a_turn_without_one_is_graded(env):
    out = env.step(
        logs(
            call("calculator", expression="347*589"),  # runs
            "The product is 204383.",  # graded: right
            "I think 204000.",  # graded: wrong
            '<tool_call>{"name": "calculator", "arguments": {"expression": "1+"}',  # never closed
            call("nope") + call("add", a=1, b=2),  # an unknown tool beside a good call
            call("add", a=1, b="2"),  # an argument of the wrong type
            call("fail", message="boom"),  # a valid call whose tool raises
            call("add", a=1, b=1) + call("add", a=2, b=2) + call("add", a=3, b=3),  # one past the limit of 2
        ),
        [{"ground_truth": "204383"}] * 8,
    )
    contents = [[m["content"] for m in o.get("messages", [])] for o in out.observations]
    assert contents == [
        ["204383"],
        [],
        [],
        ["error: malformed tool call: call 0: '<tool_call>' is never closed with '</tool_call>'"],
        ["error: unknown tool 'nope' (the tools: calculator, add, fail)", "3"],
        ["error: argument 'b': expected integer, got string"],
        ["error: ValueError: boom"],
        ["2", "4", "error: not run: at most 2 tool calls per turn"],
    ]
    answered = out.observations[4]["messages"]
    assert [(m["role"], m["name"]) for m in answered] == [("tool", "nope"), ("tool", "add")]
    assert all(m["tool_call_id"].startswith("call_") for m in answered)
    assert out.terminateds == [False, True, True, False, False, False, False, False]
    assert out.rewards == [0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert out.answers[1] == "204383"
    assert out.metadata[1] is None and out.metadata[0] == {"ground_truth": "204383"}  # done, and going on
    assert out.invalid_tool_calls == [False, False, False, True, True, True, False, True]
    assert out.metrics == {
        "invalid_tool_calls": [0, 0, 0, 1, 1, 1, 0, 1],
        "tool_calls": [1, 0, 0, 1, 2, 1, 1, 3],
        "tool_errors": [0, 0, 0, 0, 0, 0, 1, 0],
    }


def test_an_episode_calls_then_answers(env):
    log = logs(call("calculator", expression="347*589"))[0]
    first = env.step([log], [{"ground_truth": "204383"}])
    assert not first.terminateds[0]
    log += [*first.observations[0]["messages"], {"role": "assistant", "content": "So the answer is 204383."}]
    second = env.step([log], [first.metadata[0]])
    assert (second.rewards, second.terminateds, second.invalid_tool_calls) == ([1.0], [True], [False])


@pytest.mark.parametrize("on_limit", ["fail_sample", "answer"])
def test_a_tool_stopped_by_its_limit_fails_the_sample_or_is_answered(on_limit):
    """A runaway tool (a busy loop past cpu_s, an allocation past memory_mb) is killed by the sandbox; with
    fail_sample its sample ends with reward 0 and the reason as its error, beside a sample that goes on."""
    env = ToolsEnvironment(
        ToolsConfig(
            tools=["tests.tools.sandboxed:add", "tests.tools.sandboxed:spin", "tests.tools.sandboxed:hog_memory"],
            verifier="builtin",
            timeout_s=20,
            cpu_s=1,
            memory_mb=256,
            on_limit=on_limit,
        )
    )
    out = env.step(logs(call("spin"), call("add", a=1, b=2), call("hog_memory")), [{"ground_truth": "3"}] * 3)
    cpu = "tool 'spin' stopped by its cpu limit: CPU time limit: killed after 1 s of CPU time"
    memory = "tool 'hog_memory' stopped by its memory limit: memory limit exceeded (256 MB address space)"
    assert out.rewards == [0.0, 0.0, 0.0]
    assert out.observations[1]["messages"][0]["content"] == "3"
    assert out.metrics["tool_errors"] == [1, 0, 1]
    if on_limit == "fail_sample":
        assert out.terminateds == [True, False, True]
        assert out.errors == [cpu, None, memory]
        assert out.metadata[0] is None and out.metadata[2] is None
    else:
        assert out.terminateds == [False, False, False]
        assert out.errors == [None, None, None]
        answers = [out.observations[i]["messages"][0]["content"] for i in (0, 2)]
        assert answers == ["error: " + cpu.split(": ", 1)[1], "error: " + memory.split(": ", 1)[1]]


def test_the_environment_declares_its_tools_schemas(env):
    assert [t["function"]["name"] for t in env.tools] == ["calculator", "add", "fail"]
    assert env.tools[0]["function"]["parameters"]["required"] == ["expression"]


def test_its_config_is_refused_with_the_dotted_path():
    from rlcore.config import ConfigError, load_config_dict, resolve

    def problems(tools_cfg):
        with pytest.raises(ConfigError) as info:
            resolve(
                load_config_dict(
                    {
                        "env": {"name": "tools", "tools_cfg": tools_cfg},
                        "policy": {"generation": {"backend": "vllm"}},
                        "cluster": {"workers_per_node": 1},
                    }
                ),
                run=True,
            )
        return info.value.problems

    assert problems({"tools": ["calculator", "not a tool"]}) == [
        "env.tools_cfg.tools: entry 1, 'not a tool', is neither a built-in tool (calculator) nor 'module:function'"
    ]
    assert problems({"tools": []}) == [
        "env.tools_cfg.tools: list should have at least 1 item after validation, not 0, got []"
    ]
    assert problems({"tools": ["calculator"], "memory_mb": 8}) == [
        "env.tools_cfg.memory_mb: expected a value >= 32, got 8"
    ]
    with pytest.raises(ValueError, match=r"env.tools_cfg.tools\[0\]: cannot import 'no_such_module:f'"):
        ToolsEnvironment(ToolsConfig(tools=["no_such_module:f"]))


def test_a_network_namespace_asked_for_where_none_works_is_refused_when_the_environment_is_built(monkeypatch):
    from rlcore.tools import sandbox

    monkeypatch.setattr(sandbox, "network_namespace_available", lambda: False)
    with pytest.raises(ValueError, match="env.tools_cfg.isolate_network: namespace, but 'unshare -rn' does not work"):
        ToolsEnvironment(ToolsConfig(tools=["calculator"], isolate_network="namespace"))
    assert ToolsEnvironment(ToolsConfig(tools=["calculator"], isolate_network="auto")).tools  # falls back


def test_the_rollout_reports_metrics_per_sample_and_the_valid_call_rate():
    from rlcore.interfaces.environment import environment_metrics

    totals = {"tool_calls": [3.0, 1.0, 0.0, 0.0], "invalid_tool_calls": [1.0, 0.0, 0.0, 0.0], "tool_errors": [0.0] * 4}
    assert environment_metrics(totals) == {
        "env/tool_calls_per_sample": 1.0,
        "env/invalid_tool_calls_per_sample": 0.25,
        "env/tool_errors_per_sample": 0.0,
        "env/valid_tool_calls_rate": 0.75,  # 3 of the 4 calls
    }
    assert "env/valid_tool_calls_rate" not in environment_metrics({"tool_calls": [0.0], "invalid_tool_calls": [0.0]})


def test_invalid_flags_and_metrics_default_and_join():
    plain = EnvironmentReturn.final([1.0, 0.0], [{}, {}])
    assert plain.invalid_tool_calls == [False, False] and plain.metrics is None
    flagged = EnvironmentReturn(
        [{"role": "tool", "content": "x"}],
        [{}],
        [0.0],
        [False],
        invalid_tool_calls=[True],
        metrics={"tool_calls": [2]},
    )
    joined = EnvironmentReturn.concat([plain, flagged])
    assert joined.invalid_tool_calls == [False, False, True]
    assert joined.metrics == {"tool_calls": [0.0, 0.0, 2.0]}  # a part without the metric counts 0
    with pytest.raises(ValueError, match="one entry per sample"):
        EnvironmentReturn.final([1.0], [{}]).__class__([{}], [{}], [1.0], [True], invalid_tool_calls=[True, False])
    with pytest.raises(ValueError, match="not a metric name"):
        EnvironmentReturn.final([1.0], [{}]).__class__([{}], [{}], [1.0], [True], metrics={"env/x": [1.0]})


def test_in_an_environment_actor_the_tools_are_declared_and_calls_run(ray_session):
    from rlcore.environments.runner import EnvironmentRunner

    runner = EnvironmentRunner(
        "tools", "rlcore.environments.tools:ToolsEnvironment", ToolsConfig(tools=["calculator"]), num_workers=1
    )
    try:
        assert [t["function"]["name"] for t in runner.tools] == ["calculator"]  # asked of the actor
        out = runner.step(logs(call("calculator", expression="2**10")), [{"ground_truth": "1024"}])
        assert out.observations[0]["messages"][0]["content"] == "1024"  # the sandbox ran inside the Ray actor
    finally:
        runner.shutdown()
