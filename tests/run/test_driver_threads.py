"""The driver's torch ops run on one thread while a run lasts, and the caller's setting comes back after, also when
the run fails (``rlcore.run.train._one_torch_thread``)."""

from __future__ import annotations

import pytest
import torch

from rlcore.run.train import _one_torch_thread


def test_a_run_holds_one_torch_thread_and_gives_the_caller_s_setting_back() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with pytest.raises(RuntimeError, match="the run failed"), _one_torch_thread():
            assert torch.get_num_threads() == 1
            raise RuntimeError("the run failed")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
