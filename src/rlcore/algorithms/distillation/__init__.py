"""On-policy distillation: the section (``config``: :class:`~.config.DistillationConfig`), the loss (``loss``: the KL
to the teacher's top-k) and the loop (``loop``)."""

from rlcore.algorithms.distillation.loss import TEACHER_LOGITS_KEY, DistillationLossFn

__all__ = ["TEACHER_LOGITS_KEY", "DistillationLossFn"]
