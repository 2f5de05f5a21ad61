"""rlcore: a plugin-based backend framework for RL post-training of language models.

The core package holds config schemas, abstract contracts, the plugin registry
and the runtime. It imports nothing heavy at module level: torch, ray and the
engines are imported inside the functions and worker processes that use them.
"""

__version__ = "0.2.0"
