"""The Ray actor that hosts one rank of a backend's worker.

The driver only knows the backend's ``"module:Class"`` string; the class (and
torch, and the engine) is imported here, inside the worker process. So this is
where a training worker's contract is met: the class gets the keyword
arguments its constructor declares, out of those the core offers, and a class
that lacks a method of a capability its spec declares is refused, in one line,
before it is built.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any

#: Set (to a directory) in the driver of a quiet run: each worker then writes its stdout and stderr to
#: ``<dir>/<worker name>.log`` instead of the terminal (see :mod:`rlcore.run.output`).
WORKER_LOG_DIR_ENV = "RLCORE_WORKER_LOG_DIR"


class WorkerHost:
    """Sets the rank's environment, then builds and serves the backend worker."""

    def __init__(
        self,
        worker_class: str,
        env: dict[str, str],
        args: tuple,
        kwargs: dict[str, Any],
        offered: dict[str, Any] | None = None,
        capabilities: tuple[str, ...] = (),
    ) -> None:
        os.environ.update(env)
        _redirect_output(env.get("RLCORE_WORKER_NAME", f"worker-{os.getpid()}"))
        if env.get("RLCORE_CPU_THREADS"):
            import torch

            # One thread per rank: several ranks share a few cores, and oversubscription
            # makes each rank several times slower (design.md §5).
            torch.set_num_threads(int(env["RLCORE_CPU_THREADS"]))
        from rlcore.plugins import declared_kwargs, import_object

        cls = import_object(worker_class)
        if capabilities:
            from rlcore.interfaces.workers import capability_problems

            if problems := capability_problems(cls, capabilities):
                raise TypeError(problems[0])
        self.worker = cls(*args, **declared_kwargs(cls, offered or {}), **kwargs)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.worker, method)(*args, **kwargs)

    def stream(self, method: str, *args: Any, **kwargs: Any) -> Iterator[Any]:
        """A generator method of the worker, each item sent as it is yielded: Ray takes
        ``num_returns="streaming"`` only on a method that is itself a generator, which ``call`` is not
        (:meth:`rlcore.distributed.RayWorkerGroup.run_streaming_on_worker`)."""
        yield from getattr(self.worker, method)(*args, **kwargs)

    def pid(self) -> int:
        return os.getpid()

    def peak_memory(self) -> dict[str, int]:
        """Bytes: this process's peak resident memory so far, and its GPU's peak allocation if it uses one."""
        import resource

        peak = {"rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}  # Linux reports KiB
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            peak["device"] = torch.cuda.max_memory_allocated()
        return peak

    def shutdown(self) -> None:
        """Let the worker release what it holds (process groups, engines, refit buffers) before it is killed."""
        try:
            shutdown = getattr(self.worker, "shutdown", None)
            if shutdown is not None:
                shutdown()
        finally:
            from rlcore.distributed import cuda_ipc_names
            from rlcore.refit import collective, shared_memory

            shared_memory.release_sender_buffers()
            collective.release_buffers()
            cuda_ipc_names.release_own_names()


def _redirect_output(name: str) -> None:
    """In a quiet run, send this process's stdout and stderr to ``<log dir>/<name>.log``."""
    log_dir = os.environ.get(WORKER_LOG_DIR_ENV)
    if not log_dir:
        return
    fd = os.open(os.path.join(log_dir, f"{name}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
