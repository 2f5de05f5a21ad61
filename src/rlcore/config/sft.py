"""Moved: SFT's section lives in :mod:`rlcore.algorithms.sft.config`,
the offline loop's base in :mod:`rlcore.config.offline_loop`
(rlcore 0.2); this path is kept for one release and warns (:mod:`rlcore.config.moved`)."""

from rlcore.config.moved import moved_to_algorithm
from rlcore.config.offline_loop import OfflineLoopConfig

__getattr__ = moved_to_algorithm(__name__, "sft", OfflineLoopConfig=OfflineLoopConfig)
