"""What a killed engine rank leaves outside its process is removed (rl_vllm.engine_env), without an engine.

The real thing, a TP-2 engine whose ranks are SIGKILLed and restarted, is ``test_tp_engine_restart.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest


def a_dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_an_engine_rank_binds_its_ipc_sockets_in_its_own_directory_and_removes_dead_ranks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rl_vllm.engine_env import use_private_ipc_dir

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)
    dead = tmp_path / f"rlvllm-{a_dead_pid()}"
    alive = tmp_path / f"rlvllm-{os.getppid()}"  # a live process: an engine rank still running
    other = tmp_path / "rlvllm-notapid"
    for folder in (dead, alive, other):
        folder.mkdir()
        (folder / "a-socket-file").touch()
    path = use_private_ipc_dir()
    assert path == str(tmp_path / f"rlvllm-{os.getpid()}") and os.path.isdir(path)
    assert os.environ["VLLM_RPC_BASE_PATH"] == path  # where vLLM binds its ipc:// sockets
    assert not dead.exists(), "the directory of a dead rank was left"
    assert alive.exists() and other.exists(), "a live rank's directory, or one not ours, was removed"


def test_a_rank_shut_down_cleanly_removes_its_own_directory_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rl_vllm.engine_env import remove_own_ipc_dir, use_private_ipc_dir

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)
    own = Path(use_private_ipc_dir())
    (own / "a-socket-file").touch()
    remove_own_ipc_dir()
    assert not own.exists()
    mine = tmp_path / "my-own-rpc-dir"  # a VLLM_RPC_BASE_PATH the user set: never removed
    mine.mkdir()
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", str(mine))
    remove_own_ipc_dir()
    assert mine.exists()
