"""pytest fixtures for testing rlcore backends.

Not auto-loaded: a backend's test suite opts in from its root ``conftest.py`` (pytest accepts
``pytest_plugins`` only there) or from a test module::

    pytest_plugins = ["rlcore.testing.pytest_plugin"]

Fixtures:

- ``rlcore_registry``: an empty, isolated plugin :class:`~rlcore.plugins.Registry`
  installed as the process-wide registry for one test (the previous one is put
  back afterwards), so a test can ``register_plugin(obj, name=...)`` without
  installing a distribution. Only the driver needs it: ``Policy`` resolves the
  backend name there and hands the workers the worker class as a string.
- ``ray_session`` (session): one private Ray instance for the whole test session.
- ``tiny_model_dir`` / ``tiny_tokenizer`` (session): a tiny Llama built locally
  (cached on disk) and its byte-level tokenizer.
- ``make_cluster``: ``make_cluster(world_size)`` gives a ``RayVirtualCluster``
  whose placement group is removed after the test.

Nothing heavy is imported at module import time: torch and ray are imported by
the fixtures that need them.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

#: Logical CPUs of the test Ray instance. Tiny models need little CPU, and every
#: rank is pinned to one torch thread, so more ranks than cores is fine.
RAY_TEST_CPUS = 16


@pytest.fixture
def rlcore_registry() -> Iterator[Any]:
    """An empty registry that is the process-wide one for this test only."""
    with isolated_registry() as registry:
        yield registry


class isolated_registry:  # noqa: N801 - used like a function: ``with isolated_registry() as reg``
    """Context manager: install ``registry`` (default: a new empty one) and restore the previous one."""

    def __init__(self, registry: Any = None) -> None:
        from rlcore.plugins import Registry

        self.registry = registry if registry is not None else Registry()
        self._previous: Any = None

    def __enter__(self) -> Any:
        from rlcore.plugins import registry as registry_module
        from rlcore.plugins import set_registry

        # Read the slot directly: ``get_registry()`` would build one from the
        # installed entry points when none is cached, and we want to restore
        # exactly what was there (possibly nothing).
        self._previous = getattr(registry_module, "_REGISTRY", None)
        set_registry(self.registry)
        return self.registry

    def __exit__(self, *exc: object) -> None:
        from rlcore.plugins import set_registry

        set_registry(self._previous)


def _worker_pythonpath(rootdir: Path) -> str:
    """PYTHONPATH for Ray workers: the test root, this process's sys.path, then the old value.

    Ray worker processes are fresh interpreters: without this they cannot
    import test-local modules (a worker class defined next to the tests, or a
    plugin put on sys.path by a conftest). ``<root>/tests`` itself is not put
    first: its folders are named after the packages they test (``tests/datasets``),
    and would hide the libraries of those names (Hugging Face ``datasets``) from
    every process started after it; pytest's own sys.path entries come along.
    """
    entries = [str(rootdir), *sys.path]
    old = os.environ.get("PYTHONPATH")
    if old:
        entries += old.split(os.pathsep)
    seen: set[str] = set()
    out = []
    for entry in entries:
        entry = entry or os.getcwd()  # '' on sys.path means the current directory
        if entry not in seen and os.path.isdir(entry):
            seen.add(entry)
            out.append(entry)
    return os.pathsep.join(out)


@pytest.fixture(scope="session")
def ray_session(request: pytest.FixtureRequest) -> Iterator[None]:
    """A private Ray instance for the session (started once, shut down at the end).

    If Ray is already running in this process it is used as is and left
    running (its workers then see the PYTHONPATH it was started with).
    """
    os.environ["PYTHONPATH"] = _worker_pythonpath(Path(str(request.config.rootpath)))
    import ray

    from rlcore.distributed import init_ray, shutdown_ray

    if ray.is_initialized():
        yield
        return
    init_ray(num_cpus=RAY_TEST_CPUS)
    try:
        yield
    finally:
        shutdown_ray()


@pytest.fixture(scope="session")
def tiny_model_dir() -> str:
    """Directory of a tiny Llama (HF safetensors + tokenizer), built once and cached on disk."""
    from rlcore.models import tiny_model_path

    return tiny_model_path()


@pytest.fixture(scope="session")
def tiny_tokenizer() -> Any:
    """The byte-level tokenizer the tiny models use (pad 0, BOS 1, EOS 2)."""
    from rlcore.models import build_tiny_tokenizer

    return build_tiny_tokenizer()


class ClusterPool:
    """Makes ``RayVirtualCluster`` s and removes all their placement groups on :meth:`shutdown`."""

    def __init__(self) -> None:
        self.clusters: list[Any] = []

    def __call__(self, world_size: int, **kwargs: Any) -> Any:
        from rlcore.distributed import RayVirtualCluster

        cluster = RayVirtualCluster([world_size], **kwargs)
        self.clusters.append(cluster)
        return cluster

    def shutdown(self) -> None:
        while self.clusters:
            self.clusters.pop().shutdown()


@pytest.fixture
def make_cluster(ray_session: None) -> Iterator[Callable[..., Any]]:
    """Factory: ``make_cluster(world_size, **RayVirtualCluster kwargs)``; cleaned up after the test."""
    pool = ClusterPool()
    try:
        yield pool
    finally:
        pool.shutdown()
