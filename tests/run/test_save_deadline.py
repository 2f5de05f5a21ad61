"""``checkpointing.checkpoint_must_save_by`` decides as NeMo-RL's TimeoutChecker does (issue 53).

The reference is NeMo-RL's ``nemo_rl/utils/timer.py`` (TimeoutChecker with ``fit_last_save_time=True``, as
grpo.py, sft.py, dpo.py and distillation.py build it), written out below: ``mark_iteration`` then ``check_save``
at the end of each step; the clock starts when training starts.
"""

from __future__ import annotations

import pytest

from rlcore.config import ConfigError, load_config_dict
from rlcore.config.checkpointing import duration_seconds
from rlcore.run.save_deadline import SaveDeadline


def _nemo_rl_saving_step(limit_s: float, ends: list[float]) -> int | None:
    """The index of the step after which NeMo-RL saves and stops, for steps ending at times ``ends``."""
    iteration_times, previous = [], 0.0
    for i, now in enumerate(ends):
        iteration_times.append(now - previous)
        previous = now
        if now + sum(iteration_times) / len(iteration_times) >= limit_s or now >= limit_s:
            return i
    return None


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(
    ("limit", "durations"),
    [
        ("00:00:01:00", [10.0] * 10),  # 60 s, steps of 10 s: the step ending at 50 s is the last
        ("00:00:01:00", [5.0, 5.0, 40.0, 5.0, 5.0, 5.0]),  # a slow step raises the mean
        ("00:00:00:30", [45.0, 1.0]),  # the first step already passes the limit
        ("00:01:00:00", [10.0] * 5),  # never reached
        ("01:00:00:00", [3600.0] * 30),  # a day
    ],
)
def test_the_step_that_saves_and_stops_is_nemo_rl_s(limit, durations):
    clock = FakeClock()
    deadline = SaveDeadline(limit, clock=clock)
    ends, ours = [], None
    for i, d in enumerate(durations):
        clock.now += d
        ends.append(clock.now)
        if deadline.step_done() and ours is None:
            ours = i
    assert ours == _nemo_rl_saving_step(duration_seconds(limit), ends)
    assert not deadline.step_done()  # once only


def test_without_a_limit_nothing_is_due():
    clock = FakeClock()
    deadline = SaveDeadline(None, clock=clock)
    clock.now = 1e9
    assert not deadline.step_done()


def test_the_duration_is_nemo_rl_s_format_and_another_is_refused_naming_the_path():
    assert duration_seconds("00:03:45:00") == 3 * 3600 + 45 * 60
    assert duration_seconds("1:2:3:4") == 86400 + 7200 + 180 + 4
    assert load_config_dict({"checkpointing": {"checkpoint_must_save_by": "00:03:45:00"}}).checkpointing
    with pytest.raises(ConfigError) as caught:
        load_config_dict({"checkpointing": {"checkpoint_must_save_by": "3h45m"}})
    [line] = caught.value.problems
    assert line.startswith("checkpointing.checkpoint_must_save_by") and "'DD:HH:MM:SS'" in line
