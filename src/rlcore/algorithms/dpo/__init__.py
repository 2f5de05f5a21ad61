"""Direct Preference Optimization: the loop (``loop``) and how preference pairs become batches (``batches``); the
section is :class:`rlcore.config.dpo.DPOConfig`, the loss :class:`rlcore.algorithms.preference.DPOLossFn`."""
