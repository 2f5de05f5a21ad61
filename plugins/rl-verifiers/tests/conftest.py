"""rl-verifiers' tests: their verifiers tasksets (tests/envs, top-level modules as verifiers wants them) importable
here and in the subprocesses verifiers starts (a tool server runs as ``python -m <its module>``)."""

import glob
import os
import sys
from pathlib import Path

import pytest

ENVS = str(Path(__file__).parent / "envs")
if ENVS not in sys.path:
    sys.path.insert(0, ENVS)


@pytest.fixture(scope="module")
def verifiers_subprocesses():
    """PYTHONPATH for verifiers' subprocesses; removes the tool servers' port files verifiers 0.4.0 leaves in
    /tmp (``/tmp/vf-port-<hex>``, one per tool server started)."""
    before = set(glob.glob("/tmp/vf-port-*"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join(p for p in (ENVS, os.environ.get("PYTHONPATH")) if p))
        yield
    for path in set(glob.glob("/tmp/vf-port-*")) - before:
        Path(path).unlink(missing_ok=True)
