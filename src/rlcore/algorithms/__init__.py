"""Loss functions (:mod:`~rlcore.algorithms.loss_functions`, their token helpers in
:mod:`~rlcore.algorithms.utils`), GRPO's group advantages (:mod:`~rlcore.algorithms.advantages`) and
NeMo-RL's reward and advantage options: scaling, shaping, dynamic sampling's filter, overlong filtering,
clipping (:mod:`~rlcore.algorithms.reward_transforms`).

The run that uses them is :mod:`rlcore.run`.
"""
