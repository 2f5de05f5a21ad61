"""Root conftest: rlcore's pytest plugin (one Ray cluster per session, tiny local models) and GPU skips.

Plugin test suites under plugins/ get these fixtures from here; their own conftest.py files must not
redeclare ``pytest_plugins`` (pytest allows it only in the root conftest)."""

import pytest

pytest_plugins = ["rlcore.testing.pytest_plugin"]

# Plugin distributions kept as fixtures carry test suites of their own, run installed, in a subprocess
# (tests/plugins/test_plugin_template.py); they are not part of this collection.
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
    """Tag every process the suite starts and give them a private TMPDIR; the leak check at the end looks
    for what of theirs is still there."""
    global _LEAK_BASELINE
    import os
    import tempfile

    from rlcore.testing import leaks

    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", tempfile.gettempdir())  # tmp_path stays where pytest keeps it
    # NeMo-RL's sft.yaml and distillation_math.yaml switch wandb on: no test reaches wandb's servers
    # (tests/run/test_trackers.py runs it offline).
    os.environ["WANDB_MODE"] = "disabled"
    # Local JSONL/CSV files are prepared into datasets' cache on first read: the suite's go to a directory
    # of its own, removed at the end, not into the user's ~/.cache (tests of hub caches set their own). A
    # session that was killed never reaches its end: the next one removes its cache (named by its pid).
    _sweep_dead_sessions_caches(tempfile.gettempdir())
    os.environ.setdefault("HF_DATASETS_CACHE", tempfile.mkdtemp(prefix=f"{_CACHE_PREFIX}{os.getpid()}-"))
    _LEAK_BASELINE = leaks.start()


_CACHE_PREFIX = "rlcore-test-datasets-"


def _sweep_dead_sessions_caches(root: str) -> None:
    import re
    import shutil
    from pathlib import Path

    from rlcore.distributed.ray_runtime import pid_alive

    for path in Path(root).glob(f"{_CACHE_PREFIX}*"):
        owner = re.fullmatch(rf"{_CACHE_PREFIX}(\d+)-\w+", path.name)
        if owner and not pid_alive(int(owner.group(1))):
            shutil.rmtree(path, ignore_errors=True)


def pytest_sessionfinish(session, exitstatus):
    """Fail the run if the suite's processes left shared memory, temp entries or processes behind."""
    import os
    import shutil

    cache = os.environ.get("HF_DATASETS_CACHE", "")
    if os.path.basename(cache).startswith(_CACHE_PREFIX):
        shutil.rmtree(cache, ignore_errors=True)
    if _LEAK_BASELINE is None or os.environ.get("RLCORE_LEAK_CHECK") == "0":
        return
    from rlcore.testing import leaks

    found = leaks.leftovers(_LEAK_BASELINE)
    leaks.release(_LEAK_BASELINE)
    if found:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        lines = [
            "leak check: the test session left these behind:",
            *(f"  {item}" for item in found),
            "(what the suite's processes made; new shared memory nobody else holds counts as theirs: "
            "RLCORE_LEAK_CHECK=0 turns the check off)",
        ]
        if reporter is not None:
            reporter.write_line("\n".join(lines), red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
