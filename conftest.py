"""Root conftest: rlcore's pytest plugin (one Ray cluster per session, tiny local models) and GPU skips.

Plugin test suites under plugins/ get these fixtures from here; their own conftest.py files must not
redeclare ``pytest_plugins`` (pytest allows it only in the root conftest)."""

import pytest

pytest_plugins = ["rlcore.testing.pytest_plugin"]

# Plugin distributions kept as fixtures carry test suites of their own, run installed, in a subprocess
# (tests/test_plugin_template.py); they are not part of this collection.
collect_ignore_glob = ["tests/fixtures/*"]


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


_LEAK_BASELINE = None


def pytest_sessionstart(session):
    """Tag every process the suite starts; the leak check at the end looks for what is still there."""
    global _LEAK_BASELINE
    from rlcore.testing import leaks

    _LEAK_BASELINE = leaks.start()


def pytest_sessionfinish(session, exitstatus):
    """Fail the run if the suite left shared memory, rlcore/Ray temp dirs or processes behind."""
    import os

    if _LEAK_BASELINE is None or os.environ.get("RLCORE_LEAK_CHECK") == "0":
        return
    from rlcore.testing import leaks

    found = leaks.leftovers(_LEAK_BASELINE)
    if found:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        lines = ["leak check: the test session left these behind:", *(f"  {item}" for item in found),
                 "(shared memory and temp entries of other runs active at the same time show here too: "
                 "rerun alone, or set RLCORE_LEAK_CHECK=0)"]
        if reporter is not None:
            reporter.write_line("\n".join(lines), red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
