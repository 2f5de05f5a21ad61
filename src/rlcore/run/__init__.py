"""A GRPO run, as ``rlcore run`` does it: the loop and everything around it (the losses are :mod:`rlcore.algorithms`).

- :mod:`~rlcore.run.train`: a whole run from a config (build, train, log, checkpoint, summary);
- :mod:`~rlcore.run.build`: the run's pieces (cluster, policy, generation backend, synchronizer);
- :mod:`~rlcore.run.grpo`: one GRPO step and the loop over steps;
- :mod:`~rlcore.run.prompts`: the chat template and the prompt + completion length budget;
- :mod:`~rlcore.run.tasks`: where prompts and rewards come from (:mod:`~rlcore.run.tasks.toy`: the default);
- :mod:`~rlcore.run.metrics`: metrics.jsonl, TensorBoard, the progress bar, the reward plot;
- :mod:`~rlcore.run.checkpoints`: atomic step checkpoints and finding the latest;
- :mod:`~rlcore.run.stopping`: stopping on SIGINT/SIGTERM without losing a due checkpoint.
"""
