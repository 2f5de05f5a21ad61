"""GRPO, rlcore's default algorithm: its loop (synchronous, asynchronous: ``async_loop``), dynamic sampling
and the step's advantages and loss inputs (``step``); the section is :class:`rlcore.config.grpo.GRPOConfig`."""
