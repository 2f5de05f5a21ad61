"""GRPO, rlcore's default algorithm: its loop (synchronous, asynchronous: ``async_loop``), dynamic sampling
and the step's advantages and loss inputs (``step``); its section (``config``), the ``loss`` section it owns
(``loss_config``), its rules (``rules``), its loss (``loss``), advantages and reward transforms."""
