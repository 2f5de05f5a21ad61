"""Direct Preference Optimization: the loop (``loop``) and how preference pairs become batches (``batches``); the
section is :class:`rlcore.algorithms.dpo.config.DPOConfig`, the loss :class:`rlcore.algorithms.dpo.loss.DPOLossFn`."""
