"""Supervised fine-tuning: the loop (``loop``) and how a chat sample becomes a trained batch (``batches``); the
section is :class:`rlcore.config.sft.SFTConfig`, the loss :class:`rlcore.algorithms.loss_functions.NLLLoss`."""
