"""rl-dtensor: the FSDP2 + DTensor training backend of rlcore.

Kept empty on purpose: ``rl_dtensor.plugin`` is imported when rlcore lists
backends and must stay light; everything that imports torch lives in the
modules the worker imports inside its Ray process.
"""
