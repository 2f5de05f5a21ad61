# The conformance kit's fixtures (Ray session, tiny model, clusters) come from rlcore's pytest plugin.
pytest_plugins = ["rlcore.testing.pytest_plugin"]
