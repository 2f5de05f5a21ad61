"""The training algorithms, one package each (its config section, rules, loss, data and loop), registered through
the public hook (:mod:`.plugin`): :mod:`~rlcore.algorithms.grpo` (sync and async loops, dynamic sampling, GDPO,
advantages, reward transforms), :mod:`~rlcore.algorithms.sft`, :mod:`~rlcore.algorithms.dpo` and
:mod:`~rlcore.algorithms.distillation`. Each package's ``config`` module is light (pydantic only): the config layer
imports it through the registry, never by name. Shared here: the token helpers of :mod:`~rlcore.algorithms.utils`
and :mod:`~rlcore.algorithms.loss_functions`, the losses in one import place.
"""
