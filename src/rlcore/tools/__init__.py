"""Tools a model calls during a rollout: each call runs in a sandboxed child process (:mod:`.sandbox`), described
to the model by an OpenAI function schema derived from its signature (:mod:`.schema`). ``calculator``
(:mod:`.calculator`) is the built-in one. Importing this package imports nothing heavy."""
