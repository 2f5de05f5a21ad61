"""On-policy distillation: the loss (``loss``: the KL to the teacher's top-k) and the loop (``loop``); the section
is :class:`rlcore.config.distillation.DistillationConfig`."""

from rlcore.algorithms.distillation.loss import TEACHER_LOGITS_KEY, DistillationLossFn

__all__ = ["TEACHER_LOGITS_KEY", "DistillationLossFn"]
