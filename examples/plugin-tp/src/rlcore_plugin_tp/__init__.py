"""rlcore-plugin-tp: a training backend that declares its own tensor-parallel layout to rlcore.

Nothing is imported here: rlcore imports ``rlcore_plugin_tp.plugin`` to list backends, and
``rlcore_plugin_tp.layout`` and ``rlcore_plugin_tp.config`` to resolve a config; all three stay
free of torch.
"""

__version__ = "0.1.0"
