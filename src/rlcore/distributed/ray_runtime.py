"""Starting or attaching to Ray.

Default: a private, single-machine Ray on loopback with its own temp directory
and no dashboard, so a run never joins somebody else's cluster or listens on a
public interface. Given an address (config or ``RAY_ADDRESS``), attach to that
cluster instead: that is how a run goes from one machine to many.
"""

from __future__ import annotations

import os
import shutil
import tempfile

_PRIVATE_TEMP_DIR: str | None = None


# Ray resolves 127.0.0.1 to the machine's routable address unless multi-node
# clustering is off; with it off, every Ray process listens on loopback only.
_SINGLE_MACHINE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def init_ray(address: str | None = None, *, num_cpus: int | None = None, num_gpus: int | None = None) -> bool:
    """Make sure Ray is initialised; returns True when this call started a private cluster."""
    address = address or os.environ.get("RAY_ADDRESS")
    if not address:
        os.environ[_SINGLE_MACHINE_ENV] = "0"  # read by ray at import and by the processes it spawns
    import ray

    global _PRIVATE_TEMP_DIR
    if ray.is_initialized():
        return False
    if address:
        ray.init(address=address, namespace="rlcore", log_to_driver=True)
        return False
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False  # in case ray was imported before the variable was set
    # Ray starts workers at niceness 15 by default; ours are the job, not background work.
    os.environ.setdefault("RAY_worker_niceness", "0")
    # A short path: Ray's unix sockets live under it and have a ~100-byte limit.
    _PRIVATE_TEMP_DIR = tempfile.mkdtemp(prefix="rlray-", dir="/tmp")
    ray.init(
        address="local",
        num_cpus=max(num_cpus or 0, os.cpu_count() or 1),
        num_gpus=num_gpus,
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        _temp_dir=_PRIVATE_TEMP_DIR,
        namespace="rlcore",
        log_to_driver=True,
    )
    return True


def shutdown_ray() -> None:
    """Shut Ray down and remove the private temp directory, if this process made one."""
    import ray

    global _PRIVATE_TEMP_DIR
    if ray.is_initialized():
        ray.shutdown()
    if _PRIVATE_TEMP_DIR:
        shutil.rmtree(_PRIVATE_TEMP_DIR, ignore_errors=True)
        _PRIVATE_TEMP_DIR = None
