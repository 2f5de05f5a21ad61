"""Loss functions (:mod:`~rlcore.algorithms.loss_functions`, their token helpers in
:mod:`~rlcore.algorithms.utils`) and GRPO's group advantages (:mod:`~rlcore.algorithms.advantages`).

The run that uses them is :mod:`rlcore.run`.
"""
