"""The training algorithms, one package each, registered through the public hook (:mod:`.plugin`):
:mod:`~rlcore.algorithms.grpo` (sync and async loops, dynamic sampling, GDPO), :mod:`~rlcore.algorithms.sft`,
:mod:`~rlcore.algorithms.dpo` and :mod:`~rlcore.algorithms.distillation`; their config sections live in
:mod:`rlcore.config` (``grpo``, ``sft``, ``dpo``, ``distillation``), so a config validates without this package.
The losses they share: :mod:`~rlcore.algorithms.loss_functions` (ClippedPGLossFn, NLLLoss; token helpers in
:mod:`~rlcore.algorithms.utils`), :mod:`~rlcore.algorithms.preference` (DPO), GRPO's advantages
(:mod:`~rlcore.algorithms.advantages`) and reward transforms (:mod:`~rlcore.algorithms.reward_transforms`).
"""
