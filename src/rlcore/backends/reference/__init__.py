"""The ``reference`` training backend: plain torch data parallel, every rank holding the whole model.

``plugin`` registers it (entry point ``reference`` of the ``rlcore`` distribution); ``worker`` is the
Ray worker, imported only inside the worker processes.
"""
