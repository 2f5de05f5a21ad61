"""The in-driver environment honours env.timeout_s as the worker environments do (issue 45, item 8).

A reward that hangs (a sleep, a socket read without a timeout, a retry loop that catches Exception) fails its
batch's samples at the deadline with the same kind of line as a worker's, the batch stops the run as a worker's
would, and the next batch gets a new environment object. No Ray: the runner is called directly.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

from rlcore.environments.deadline import StepTimedOut, call_with_deadline
from rlcore.environments.python_reward import PythonRewardConfig
from rlcore.environments.runner import EnvironmentFailed, EnvironmentRunner

PYTHON_ENV = "rlcore.environments.python_reward:PythonRewardEnvironment"

#: Whether each call of :func:`hangs_on_slow` ran on the main thread (the in-driver environment stays there).
ON_MAIN_THREAD: list[bool] = []


def hangs_on_slow(prompts, completions, how="sleep"):
    """1 per completion; a batch holding 'slow' hangs (sleeps, reads a silent socket, or retries forever)."""
    ON_MAIN_THREAD.append(threading.current_thread() is threading.main_thread())
    if "slow" in completions:
        if how == "sleep":
            time.sleep(60)
        elif how == "socket":
            quiet, _other = socket.socketpair()
            quiet.recv(1)  # an HTTP call without a timeout, to a server that never answers
        else:
            while True:  # a retry loop that swallows every Exception
                try:
                    time.sleep(60)
                except Exception:  # noqa: BLE001
                    pass
    return [1.0] * len(completions)


def _logs(*completions):
    return [[{"role": "user", "content": "q"}, {"role": "assistant", "content": c}] for c in completions]


def _runner(how="sleep", timeout_s=0.5):
    config = PythonRewardConfig(reward="tests.environments.test_env_timeouts:hangs_on_slow", kwargs={"how": how})
    return EnvironmentRunner("python", PYTHON_ENV, config, timeout_s=timeout_s)


@pytest.mark.parametrize("how", ["sleep", "socket", "swallowing"])
def test_a_hanging_reward_in_the_driver_fails_its_samples_at_env_timeout_s(how, monkeypatch):
    runner = _runner(how)
    first = runner.local
    closed = []
    monkeypatch.setattr(first, "close", lambda: closed.append(first), raising=False)
    started = time.monotonic()
    with pytest.raises(EnvironmentFailed) as err:
        runner.step(_logs("a", "slow", "c"), [{}] * 3)
    took = time.monotonic() - started
    assert 0.5 <= took < 3.0  # the deadline, then at most a repeated interrupt
    # the same line as a worker's ("environment 'flaky' actor 1 timed out after 3s (env.timeout_s)"); the whole batch
    # was the driver's share, so every sample failed and the run stops, as with one worker
    assert str(err.value) == (
        "environment 'python': all 3 samples failed; the first: environment 'python' timed out "
        "after 0.5s in the driver (env.timeout_s)"
    )
    assert runner.local is not first and closed == [first]  # replaced, as a worker's actor is; what it held freed
    assert runner.step(_logs("a", "b"), [{}] * 2).rewards == [1.0, 1.0]


def test_the_driver_environment_stays_on_the_main_thread_where_signals_work():
    ON_MAIN_THREAD.clear()
    assert _runner().step(_logs("a"), [{}]).rewards == [1.0]
    assert ON_MAIN_THREAD == [True]  # math_verify's signal.alarm timeouts still work there


def test_on_another_thread_the_late_call_is_abandoned_and_its_environment_replaced():
    """Async GRPO's rollout thread: signals cannot reach it, so the call runs on a thread of its own."""
    runner = _runner("sleep")
    first = runner.local
    outcome = {}

    def rollout_thread():
        started = time.monotonic()
        try:
            runner.step(_logs("slow"), [{}])
        except EnvironmentFailed as exc:
            outcome["error"] = str(exc)
        outcome["took"] = time.monotonic() - started
        outcome["next"] = runner.step(_logs("a"), [{}]).rewards

    thread = threading.Thread(target=rollout_thread)
    thread.start()
    thread.join(10)
    assert not thread.is_alive()
    assert 0.5 <= outcome["took"] < 3.0
    assert outcome["error"].endswith("timed out after 0.5s in the driver (env.timeout_s)")
    assert runner.local is not first and outcome["next"] == [1.0]


def test_the_deadline_returns_results_and_errors_unchanged():
    assert call_with_deadline(lambda: 7, 1.0) == 7
    with pytest.raises(KeyError):
        call_with_deadline(lambda: {}["x"], 1.0)
    with pytest.raises(StepTimedOut) as err:
        call_with_deadline(lambda: time.sleep(5), 0.2)
    assert not err.value.abandoned
    for _ in range(50):  # calls that return near their deadline leave no stray interrupt behind
        try:
            call_with_deadline(lambda: time.sleep(0.002), 0.002)
        except StepTimedOut:
            pass
    time.sleep(1.2)  # a repeated interrupt would have been sent by now; none reaches this code


def test_timeout_s_documents_the_driver():
    from rlcore.config.data import EnvConfig

    description = EnvConfig.model_fields["timeout_s"].description
    assert "in the driver" in description
    assert "no timeout" not in EnvConfig.model_fields["num_workers"].description
