"""A run, as ``rlcore run`` does it: everything around an algorithm's loop, which it reaches only through the
registry (the algorithms, their loops and losses: :mod:`rlcore.algorithms`; this package never imports them).

- :mod:`~rlcore.run.train`: a whole run from a config (build, train, log, checkpoint, summary);
- :mod:`~rlcore.run.build`: the run's pieces (cluster, policy, generation backend, synchronizer);
- :mod:`~rlcore.run.rollouts`, :mod:`~rlcore.run.step`, :mod:`~rlcore.run.validation`: what the rollout loops
  share (generate and score over turns, refit, the training batch, greedy validation);
- :mod:`~rlcore.run.prompts`: the chat template and the prompt + completion length budget;
- :mod:`~rlcore.run.tasks`: where prompts and rewards come from (:mod:`~rlcore.run.tasks.toy`: the default);
- :mod:`~rlcore.run.metrics`: metrics.jsonl, TensorBoard, the progress bar, the reward plot;
- :mod:`~rlcore.run.checkpoints`: atomic step checkpoints and finding the latest;
- :mod:`~rlcore.run.stopping`: stopping on SIGINT/SIGTERM without losing a due checkpoint.
"""
