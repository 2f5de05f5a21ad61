"""Moved: the ``loss`` section is GRPO's, :mod:`rlcore.algorithms.grpo.loss_config`
(rlcore 0.2); this path is kept for one release and warns (:mod:`rlcore.config.moved`)."""

from rlcore.config.moved import moved_to_algorithm

__getattr__ = moved_to_algorithm(__name__, "grpo", "loss")
