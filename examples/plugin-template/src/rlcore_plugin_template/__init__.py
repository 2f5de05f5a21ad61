"""rlcore-plugin-template: a minimal third-party training backend for rlcore.

Nothing is imported here: rlcore imports ``rlcore_plugin_template.plugin`` to
list backends, and that must stay free of torch (see README.md).
"""

__version__ = "0.1.0"
