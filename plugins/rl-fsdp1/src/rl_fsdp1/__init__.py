"""rl-fsdp1: the ``fsdp1`` training backend of rlcore.

torch ``FullyShardedDataParallel`` (FSDP1) for data-parallel training, and
Hugging Face ``generate`` on the gathered parameters for rollouts. The worker
lives in :mod:`rl_fsdp1.worker`; this package's top level stays light (no
torch import) because :mod:`rl_fsdp1.plugin` is imported to list backends.
"""

__version__ = "0.1.0"
