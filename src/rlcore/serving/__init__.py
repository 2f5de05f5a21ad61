"""The policy served over an OpenAI-compatible HTTP endpoint during rollouts (docs/agents.md).

:mod:`rlcore.serving.server` is the HTTP layer (stdlib, loopback only), :mod:`rlcore.serving.service` what a request
does (validation, the engine call, the response), :mod:`rlcore.serving.episodes` the token ids each rollout id's
turns produced, and :mod:`rlcore.serving.agent_environment` the built-in ``agent`` environment. Nothing here imports
torch or an engine at module level.
"""
