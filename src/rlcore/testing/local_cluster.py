"""A multi-node Ray cluster on one machine, for tests: ``ray start`` per node, all on loopback.

Each node is a real raylet with its own resources and temp dir, started the
way an operator starts one on a real cluster; drivers attach through
``RAY_ADDRESS`` (:meth:`LocalRayCluster.driver_env`) exactly as ``rlcore run``
does there. The cluster has its own random auth token. Node ``i`` keeps its
files in its own temp dir under the cluster's, so its processes are the ones
holding files there: a test can lose a node (:meth:`kill_node`), and
:meth:`shutdown` stops everything with the reaper that stops a private Ray (no
``ray stop``, which would stop every Ray of the user on the machine).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rlcore.distributed.reaper import SESSION_ENV, reap, session_pids


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalRayCluster:
    """``cpus_per_node[i]`` CPUs on node ``i``; node 0 is the head. Use as a context manager."""

    def __init__(self, cpus_per_node: list[int]) -> None:
        self.cpus_per_node = list(cpus_per_node)
        self.root = tempfile.mkdtemp(prefix="rlray-mn-", dir="/tmp")  # short: Ray's socket paths live under it
        self.name = Path(self.root).name
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        self._token = secrets.token_hex(32)

    def driver_env(self) -> dict[str, str]:
        """What a driver process needs to attach to this cluster."""
        return {"RAY_ADDRESS": self.address, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self._token}

    def _node_dir(self, index: int) -> str:
        return os.path.join(self.root, f"n{index}")

    def _start_node(self, index: int) -> None:
        worker_tmp = os.path.join(self.root, "tmp")  # the workers' temp files go when the cluster does
        os.makedirs(worker_tmp, exist_ok=True)
        env = {
            **os.environ,
            **self.driver_env(),
            SESSION_ENV: self.root,
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1",
            "TMPDIR": worker_tmp,
        }
        env.pop("RAY_ADDRESS")
        where = (
            ["--head", f"--port={self.port}", "--include-dashboard=false"]
            if index == 0
            else [f"--address={self.address}"]
        )
        cmd = [
            os.path.join(os.path.dirname(sys.executable), "ray"),
            "start",
            *where,
            "--node-ip-address=127.0.0.1",
            f"--num-cpus={self.cpus_per_node[index]}",
            "--num-gpus=0",
            f"--temp-dir={self._node_dir(index)}",
            "--disable-usage-stats",
        ]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
        if out.returncode != 0:
            raise RuntimeError(f"ray start (node {index}) failed: {out.stderr[-2000:]}")

    def start(self) -> LocalRayCluster:
        """Start every node and wait until the head sees them all alive."""
        for index in range(len(self.cpus_per_node)):
            self._start_node(index)
        self.wait_for_nodes(len(self.cpus_per_node))
        return self

    def alive_nodes(self) -> int:
        script = "import ray; ray.init(log_to_driver=False); print(sum(n['Alive'] for n in ray.nodes()))"
        out = subprocess.run(
            [sys.executable, "-c", script],
            env={**os.environ, **self.driver_env()},
            capture_output=True,
            text=True,
            timeout=120,
        )
        return int(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else -1

    def wait_for_nodes(self, count: int, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while (alive := self.alive_nodes()) != count:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{alive} of {count} Ray nodes alive after {timeout_s:.0f}s")
            time.sleep(1.0)

    def node_pids(self, index: int) -> list[int]:
        return session_pids(self._node_dir(index), driver=os.getpid())

    def kill_node(self, index: int) -> int:
        """SIGKILL the raylet and every process started with it (a node lost); returns how many."""
        pids = self.node_pids(index)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return len(pids)

    def shutdown(self) -> None:
        reap(self.root, driver=os.getpid())
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> LocalRayCluster:
        try:
            return self.start()
        except BaseException:
            self.shutdown()
            raise

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
