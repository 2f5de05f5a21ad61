"""Moved: GRPO's section lives in :mod:`rlcore.algorithms.grpo.config`,
checkpointing in :mod:`rlcore.config.checkpointing`
(rlcore 0.2); this path is kept for one release and warns (:mod:`rlcore.config.moved`)."""

from rlcore.config.checkpointing import CheckpointingConfig
from rlcore.config.logger import LoggerConfig
from rlcore.config.moved import moved_to_algorithm

__getattr__ = moved_to_algorithm(__name__, "grpo", CheckpointingConfig=CheckpointingConfig, LoggerConfig=LoggerConfig)
