"""The rlcore conformance kit, run exactly as a third-party backend author would run it."""

from rlcore.testing.conformance import TrainingBackendConformance


class TestFSDP1Backend(TrainingBackendConformance):
    """``fsdp1`` installed through its ``rlcore.plugins`` entry point; dp=2 against 1 rank and the oracle."""

    backend_name = "fsdp1"
