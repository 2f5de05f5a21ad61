"""Backends that ship with the core distribution, registered through the same public hook as any plugin.

- :mod:`rlcore.backends.reference`: the smallest correct training backend (plain torch data parallel),
  and the template the conformance kit's fixtures and ``examples/plugin-template`` follow.
"""
