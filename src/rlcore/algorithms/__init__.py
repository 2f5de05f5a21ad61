"""Loss functions (:mod:`~rlcore.algorithms.loss_functions`, their token helpers in
:mod:`~rlcore.algorithms.utils`) and GRPO's group advantages (:mod:`~rlcore.algorithms.advantages`).

The run that uses them is :mod:`rlcore.run`; the modules ``grpo``, ``prompts``,
``run_log``, ``run_checkpoint`` and ``toy_task`` here only re-export it.
"""
