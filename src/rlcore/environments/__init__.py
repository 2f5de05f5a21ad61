"""The built-in environments (``digits``, ``math``, ``exact_match``, ``regex``, ``python``, ``guessing``) and what
runs them; the built-in ``reward_model`` environment starts a Policy of its own, so it lives above the policy layer,
in :mod:`rlcore.algorithms.rm.environment`.

They register through the same public hook as a third party's
(:mod:`rlcore.environments.plugin`); :mod:`rlcore.environments.runner` runs
the selected one in the driver or in Ray actors.
"""
