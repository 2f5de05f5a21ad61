"""Starting or attaching to Ray.

Default: a private, single-machine Ray on loopback with its own temp directory
and no dashboard, so a run never joins somebody else's cluster or listens on a
public interface. Given an address (config or ``RAY_ADDRESS``), attach to that
cluster instead: that is how a run goes from one machine to many.

The private instance lives exactly as long as the process that started it: a
reaper process (:mod:`rlcore.distributed.reaper`) stops it and removes its
temp directory when that process exits, however it exits (design.md §2.9).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rlcore.distributed.startup_signals import deferred_signals, signal_self_at

#: The running private instance: its temp dir and its reaper (None when attached or not started).
_PRIVATE: dict[str, Any] = {}

# Ray resolves 127.0.0.1 to the machine's routable address unless multi-node
# clustering is off; with it off, every Ray process listens on loopback only.
_SINGLE_MACHINE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
_TEMP_ROOT = "/tmp"  # a short path: Ray's unix sockets live under it and have a ~100-byte limit


def init_ray(address: str | None = None, *, num_cpus: int | None = None, num_gpus: int | None = None) -> bool:
    """Make sure Ray is initialised; returns True when this call started a private cluster."""
    address = address or os.environ.get("RAY_ADDRESS")
    if not address:
        os.environ[_SINGLE_MACHINE_ENV] = "0"  # read by ray at import and by the processes it spawns
    import ray

    if ray.is_initialized():
        return False
    from rlcore.distributed.worker_host import WORKER_LOG_DIR_ENV

    log_to_driver = WORKER_LOG_DIR_ENV not in os.environ  # a quiet run: workers write their own log files
    if address:
        ray.init(address=address, namespace="rlcore", log_to_driver=log_to_driver)
        return False
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False  # in case ray was imported before the variable was set
    # Ray starts workers at niceness 15 by default; ours are the job, not background work.
    os.environ.setdefault("RAY_worker_niceness", "0")
    sweep_orphaned_temp_dirs()
    with deferred_signals(cleanup=shutdown_ray):  # a stop half-way through ray.init crashed the driver
        _start_private(ray, num_cpus, num_gpus, log_to_driver)
    return True


def _start_private(ray: Any, num_cpus: int | None, num_gpus: int | None, log_to_driver: bool) -> None:
    """Start the private instance: its temp dir, its reaper, then Ray itself."""
    from rlcore.distributed.reaper import SESSION_ENV  # not at module level: ``-m reaper`` imports this package

    temp_dir = tempfile.mkdtemp(prefix=f"rlray-{os.getpid()}-", dir=_TEMP_ROOT)
    reaper = subprocess.Popen(
        [sys.executable, "-m", "rlcore.distributed.reaper", temp_dir, str(os.getpid())],
        stdin=subprocess.PIPE,
        start_new_session=True,
    )
    _PRIVATE.update(temp_dir=temp_dir, reaper=reaper)
    previous = {name: os.environ.get(name) for name in (SESSION_ENV, "TMPDIR")}
    tempfile.gettempdir()  # the driver's own temp dir stays where it is (tempfile remembers it)
    os.environ[SESSION_ENV] = temp_dir  # inherited by every Ray process: how the reaper finds them
    # ... and so is the temp dir: what a worker's libraries leave there (megatron's pymp-* manager
    # directories, vLLM's rendezvous files) goes with the session however the workers end
    os.environ["TMPDIR"] = os.path.join(temp_dir, "tmp")
    os.mkdir(os.environ["TMPDIR"])
    sigterm_handler = signal.getsignal(signal.SIGTERM)
    try:
        signal_self_at("ray_start")
        with _keeping_our_sigterm_handler():
            ray.init(
                address="local",
                num_cpus=max(num_cpus or 0, os.cpu_count() or 1),
                num_gpus=num_gpus,
                _node_ip_address="127.0.0.1",
                include_dashboard=False,
                _temp_dir=temp_dir,
                namespace="rlcore",
                log_to_driver=log_to_driver,
            )
        _restore_sigterm(sigterm_handler)  # before the hook: a SIGTERM from here on is the program's
        signal_self_at("ray_started")
    except BaseException:
        shutdown_ray()
        raise
    finally:
        _restore_sigterm(sigterm_handler)
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _restore_sigterm(handler: Any) -> None:
    """Ray's driver installs a C-level crash handler for SIGTERM that aborts the process; give the
    Python handler the program had (e.g. ``rlcore run``'s graceful stop) its signal back."""
    if callable(handler) and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)


def shutdown_ray(timeout_s: float = 30.0) -> None:
    """Shut Ray down; for a private instance, wait until its reaper has stopped every process of it."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    abandon_private_ray(timeout_s)


def abandon_private_ray(timeout_s: float | None = 5.0) -> None:
    """Stop the private instance without a word to Ray, whose GCS may be gone (a signal to the whole process
    group kills it first) so that any call to it would wait: the reaper stops every process of the session
    and removes its temp dir. ``timeout_s=None``: do not wait for it (the process is about to end; the reaper,
    in a session of its own, finishes the job). Nothing for an attached cluster (its actors go with this
    driver's connection)."""
    reaper = _PRIVATE.pop("reaper", None)
    temp_dir = _PRIVATE.pop("temp_dir", None)
    if reaper is not None:
        reaper.stdin.close()  # EOF: the reaper stops what is left and removes the temp dir
        if timeout_s is None:
            return
        try:
            reaper.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            reaper.kill()
    if temp_dir:
        shutil.rmtree(temp_dir, ignore_errors=True)


@contextlib.contextmanager
def _keeping_our_sigterm_handler() -> Iterator[None]:
    """``ray.init`` sets SIGTERM handlers of its own (``sys.exit(15)`` while it connects, then one that drains
    the node and exits 1): a SIGTERM during start-up then ended the run with rc 15 or 1 and no line. For the
    block, Ray's requests to set one are declined, so the program's handler (or a deferring one) keeps it."""
    from ray._private import utils

    original = getattr(utils, "set_sigterm_handler", None)
    if original is None:  # another Ray: _restore_sigterm still puts ours back afterwards
        yield
        return
    utils.set_sigterm_handler = lambda handler: None
    try:
        yield
    finally:
        utils.set_sigterm_handler = original


def sweep_orphaned_temp_dirs(root: str = _TEMP_ROOT) -> list[str]:
    """Remove private-Ray temp dirs whose driver is gone (e.g. its reaper was killed too); returns them."""
    removed = []
    for path in Path(root).glob("rlray-*-*"):
        match = re.fullmatch(r"rlray-(\d+)-\w+", path.name)
        if match and not pid_alive(int(match.group(1))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(str(path))
    return removed


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (somebody else's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # somebody else's process
        return True
    return True
