"""A CUDA IPC producer's own /dev/shm names, and no one else's (the worker removes them at shutdown)."""

from __future__ import annotations

import os

from rlcore.distributed.cuda_ipc_names import own_names, release_own_names


def test_own_names_are_the_drivers_and_torchs_for_this_pid_and_user_only() -> None:
    names = [
        "cuda.shm.0.465.1",  # pid 1125 in hex, uid 0: ours
        "torch_1125_2002986941_0",  # torch's reference counter of pid 1125: ours
        "cuda.shm.0.4651.1",  # another pid whose hex starts the same
        "cuda.shm.1000.465.1",  # the same pid number under another user
        "torch_11250_1_0",  # another pid whose decimal starts the same
        "psm_abc",
        "rlcore-refit-1125",
    ]
    assert own_names(1125, 0, names) == ["cuda.shm.0.465.1", "torch_1125_2002986941_0"]


def test_a_process_that_never_used_cuda_removes_nothing(tmp_path) -> None:
    mine = tmp_path / f"torch_{os.getpid()}_2_0"  # a name of this process's, had it shared CUDA tensors
    mine.write_text("")
    assert release_own_names(tmp_path) == []
    assert mine.exists()
