"""The 'template' backend passes rlcore's conformance kit."""

import pytest

from rlcore.testing.conformance import TrainingBackendConformance

# Skip (rather than fail to collect) where the template is not installed, e.g.
# when rlcore's own test run walks into this example directory.
pytest.importorskip("rlcore_plugin_template")


class TestTemplateBackend(TrainingBackendConformance):
    backend_name = "template"
    plugin = None  # found through the installed entry point, as users will find it
    world_size = 2

    def policy_overrides(self):
        # Tiny buckets, so that the two-rank tests really split gradients into several collectives.
        return {"template_cfg": {"grad_bucket_mb": 0.05}}
