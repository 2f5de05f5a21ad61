"""rl-megatron: the megatron-core training backend of rlcore.

Importing this package is light (no torch, no megatron): the plugin module
(:mod:`rl_megatron.plugin`) only declares the backend; the worker
(:mod:`rl_megatron.worker`) is imported inside the Ray worker processes.
"""

__version__ = "0.1.0"
