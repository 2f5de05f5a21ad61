"""Reward-model training (``rm``): a Bradley-Terry loss on preference pairs over a value model (a language model's
trunk plus a scalar ``score`` head). The section is :class:`rlcore.algorithms.rm.config.RMConfig`, the loss
:class:`rlcore.algorithms.rm.loss.BradleyTerryLossFn`, the loop :class:`rlcore.algorithms.rm.loop.RM`; how a
sequence's reward is read from the head's output (the score at its last token) is
:func:`rlcore.algorithms.rm.scoring.last_token_scores`."""
