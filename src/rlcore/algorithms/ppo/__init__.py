"""PPO with a critic (NeMo-RL's ``nemo_rl/algorithms/ppo.py``), as a library its loop calls: the ``ppo`` section
and the critic's loss section, NeMo-RL's ``value_loss_fn`` (:mod:`.config`); per-token generalized advantage
estimation with VAPO's decoupled and length-adaptive lambda (:mod:`.gae`); the clipped value loss the critic trains
on (:mod:`.value_loss`); and the rewards GAE reads: GRPO's scaling and shaping, then the sequence reward placed on
the last generated token, with the KL penalty per token when it is in the reward (:mod:`.rewards`). The policy's
loss is GRPO's :class:`~rlcore.algorithms.grpo.loss.ClippedPGLossFn` on PPO's per-token advantages. Importing the
modules of the library imports no torch."""
