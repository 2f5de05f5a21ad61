"""The user's code in the log, and a run that stops when too many samples fail (issue 44, item 7).

A reward function that raises on some samples keeps its metric (reward 0, a line in the result's errors, which
the rollout counts in env/errors) and now has its traceback, file and line in logs/environment_errors.log, once
per distinct error with a count. More than env.max_failure_fraction of a batch failing stops the run in one line
naming the error, its file:line and that log. No Ray: the runner (and an actor's body) is called directly.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rlcore.environments.failures import FILE_NAME
from rlcore.environments.python_reward import PythonRewardConfig
from rlcore.environments.runner import EnvironmentFailed, EnvironmentHost, EnvironmentRunner

PYTHON_ENV = "rlcore.environments.python_reward:PythonRewardEnvironment"
THIS_FILE = str(Path(__file__).resolve())


def _line_of(marker: str) -> int:
    """The line of this file that ends with ``marker`` (so the test does not hard-code line numbers)."""
    lines = [i for i, text in enumerate(Path(__file__).read_text().splitlines(), 1) if text.endswith(marker)]
    assert len(lines) == 1, marker
    return lines[0]


def raises_on_bad(prompts, completions):
    """The completion's length; 'bad...' raises ValueError (a message naming the sample), 'json' fails to parse."""
    scores = []
    for c in completions:
        if c.startswith("bad"):
            raise ValueError(f"cannot score {c!r}")  # marker: bad
        if c == "json":
            json.loads("{not json")  # marker: json
        scores.append(float(len(c)))
    return scores


def _runner(tmp_path, **kwargs):
    config = PythonRewardConfig(reward="tests.environments.test_env_failures:raises_on_bad")
    return EnvironmentRunner("python", PYTHON_ENV, config, log_dir=tmp_path / "logs", **kwargs)


def _logs(*completions):
    return [[{"role": "user", "content": "q"}, {"role": "assistant", "content": c}] for c in completions]


def test_a_raising_reward_is_logged_once_per_distinct_error_with_its_count(tmp_path):
    runner = _runner(tmp_path)
    out = runner.step(_logs("ab", "bad1", "abc", "json", "a"), [{}] * 5)
    assert out.rewards == [2.0, 0.0, 3.0, 0.0, 1.0]  # the metric stays: failed samples score 0 with their error
    assert out.errors == [
        None,
        "ValueError: cannot score 'bad1'",
        None,
        "JSONDecodeError: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)",
        None,
    ]
    runner.step(_logs("bad2", "x", "bad3", "yy"), [{}] * 4)  # the same error (type, file, line), other messages

    text = (tmp_path / "logs" / FILE_NAME).read_text()
    bad, parse = f"{THIS_FILE}:{_line_of('# marker: bad')}", f"{THIS_FILE}:{_line_of('# marker: json')}"
    assert text.startswith("rlcore: environment 'python' raised 2 distinct errors on 4 samples")
    headers = [line for line in text.splitlines() if line.startswith("--- ")]
    assert headers == [
        f"--- ValueError at {bad}: 3 samples; the first: ValueError: cannot score 'bad1'",
        f"--- JSONDecodeError at {parse}: 1 sample; the first: JSONDecodeError: Expecting property "
        "name enclosed in double quotes: line 1 column 2 (char 1)",
    ]  # the user's line, not json's
    assert text.count("Traceback (most recent call last)") == 2  # each traceback once, not once per sample
    assert text.count(f'File "{THIS_FILE}", line {_line_of("# marker: bad")}') == 1


def test_an_environment_actor_hands_its_failures_back_with_its_results():
    host = EnvironmentHost(PYTHON_ENV, PythonRewardConfig(reward="tests.environments.test_env_failures:raises_on_bad"))
    result, failures = host.step_with_failures(_logs("a", "bad", "json"), [{}] * 3)
    assert result.rewards == [1.0, 0.0, 0.0]
    assert failures[0] is None
    assert [(f.error.split(":")[0], f.line) for f in failures[1:]] == [
        ("ValueError", _line_of("# marker: bad")),
        ("JSONDecodeError", _line_of("# marker: json")),
    ]
    assert {f.file for f in failures[1:]} == {THIS_FILE}


def test_more_than_max_failure_fraction_of_a_batch_stops_the_run_in_one_line(tmp_path):
    runner = _runner(tmp_path)
    # 2 of 4 is within the default 0.5
    assert runner.step(_logs("a", "bad", "b", "bad"), [{}] * 4).rewards == [1.0, 0.0, 1.0, 0.0]
    with pytest.raises(EnvironmentFailed) as err:
        runner.step(_logs("bad1", "a", "bad2", "bad3"), [{}] * 4)
    message = str(err.value)
    assert "\n" not in message
    assert message == (
        f"environment 'python': 3 of 4 samples failed, more than env.max_failure_fraction (0.5) "
        f"allows; the first: ValueError: cannot score 'bad1' (at {THIS_FILE}:{_line_of('# marker: bad')}"
        f"; traceback in {tmp_path / 'logs' / FILE_NAME})"
    )
    strict = _runner(tmp_path, max_failure_fraction=0.0)
    with pytest.raises(EnvironmentFailed, match=r"1 of 5 samples failed, more than env.max_failure_fraction \(0\)"):
        strict.step(_logs("a", "b", "json", "c", "d"), [{}] * 5)
    lenient = _runner(tmp_path, max_failure_fraction=1.0)
    assert lenient.step(_logs("bad", "bad", "a"), [{}] * 3).rewards == [0.0, 0.0, 1.0]
    with pytest.raises(EnvironmentFailed, match=re.escape("all 2 samples failed; the first: ValueError: cannot score")):
        lenient.step(_logs("bad", "bad"), [{}] * 2)  # a batch with no scored sample always stops


def test_max_failure_fraction_is_a_validated_env_setting():
    from rlcore.config import ConfigError, load_config_dict, resolve
    from rlcore.config.data import EnvConfig

    assert EnvConfig().max_failure_fraction == 0.5
    with pytest.raises(ConfigError) as info:
        resolve(load_config_dict({"env": {"max_failure_fraction": 1.5}, "cluster": {"workers_per_node": 1}}), run=True)
    assert any(p.startswith("env.max_failure_fraction") for p in info.value.problems), info.value.problems


def test_the_line_named_is_the_users_deepest_not_rlcores_nor_a_librarys():
    import sysconfig
    from traceback import FrameSummary

    from rlcore.environments.failures import user_frame

    rlcore_dir = Path(__file__).resolve().parents[2] / "src" / "rlcore" / "environments"
    site = Path(sysconfig.get_paths()["purelib"]).resolve()

    def frames(*paths):
        return [FrameSummary(str(p), i + 1, "f", lookup_line=False) for i, p in enumerate(paths)]

    called_from_rlcore = [rlcore_dir / "runner.py", rlcore_dir / "python_reward.py"]
    plugin = frames(
        *called_from_rlcore, site / "myplugin" / "env.py", site / "myplugin" / "util.py", site / "numpy" / "core.py"
    )
    assert user_frame(plugin).filename == str(site / "myplugin" / "util.py")  # an installed plugin's own line
    script = frames(*called_from_rlcore, "/home/me/reward.py", site / "numpy" / "core.py")
    assert user_frame(script).filename == "/home/me/reward.py"
    assert user_frame(frames(*called_from_rlcore)).filename == str(rlcore_dir / "python_reward.py")  # rlcore's own


def test_an_unwritable_log_directory_costs_the_log_not_the_run(tmp_path):
    (tmp_path / "logs").write_text("a file where the directory should be")
    runner = _runner(tmp_path)
    with pytest.raises(EnvironmentFailed) as err:
        runner.step(_logs("bad", "bad", "a"), [{}] * 3)
    assert str(err.value).endswith(f"(at {THIS_FILE}:{_line_of('# marker: bad')})")  # no log file to point at
