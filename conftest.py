"""Root conftest: rlcore's pytest plugin (one Ray cluster per session, tiny local models) and GPU skips.

Plugin test suites under plugins/ get these fixtures from here; their own conftest.py files must not
redeclare ``pytest_plugins`` (pytest allows it only in the root conftest)."""

import pytest

pytest_plugins = ["rlcore.testing.pytest_plugin"]


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
