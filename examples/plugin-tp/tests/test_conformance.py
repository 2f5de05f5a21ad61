"""The 'tpexample' backend passes rlcore's conformance kit at tp 2 × dp 2, against a single-process oracle."""

import pytest

from rlcore.testing.conformance import TrainingBackendConformance

# Skip (rather than fail to collect) where the plugin is not installed.
pytest.importorskip("rlcore_plugin_tp")


class TestTPBackend(TrainingBackendConformance):
    backend_name = "tpexample"
    plugin = None  # found through the installed entry point
    world_size = 4  # tp 2 × dp 2: rlcore gives the two replicas different halves of every batch

    def policy_overrides(self):
        return {"tpexample_cfg": {"tensor_parallel_size": 2}}

    def single_rank_policy_overrides(self):
        return {"tpexample_cfg": {"tensor_parallel_size": 1}}
