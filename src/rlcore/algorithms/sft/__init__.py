"""Supervised fine-tuning: the loop (``loop``) and how a chat sample becomes a trained batch (``batches``); the
section is :class:`rlcore.algorithms.sft.config.SFTConfig`, the loss :class:`rlcore.algorithms.sft.loss.NLLLoss`."""
