"""Moved: a run's step checkpoints are :mod:`rlcore.run.checkpoints`."""

from rlcore.run.checkpoints import latest_step, save_step, step_dir

__all__ = ["latest_step", "save_step", "step_dir"]
