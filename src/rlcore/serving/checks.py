"""Whether a run that serves the endpoint can: before any process starts, one line per problem.

The endpoint sends each request on its own, so it needs a generation backend that serves requests continuously
(the 'async_engine' capability, configured so: rl-vllm's ``vllm_cfg.async_engine: true``, which rl-vllm's own
checks hold its section to). A run serves it when ``policy.generation.expose_http_server`` is true or its
environment is an agent environment (the built-in ``agent``, or any environment class with ``run_episode``).
"""

from __future__ import annotations

from typing import Any

#: The built-in agent environment's name (``env.name``).
AGENT_ENVIRONMENT = "agent"
FIX = "use a backend that does (rl-vllm with policy.generation.vllm_cfg.async_engine: true)"
#: The refusal, once the generation backend is built, of one that does not serve requests continuously.
NOT_CONTINUOUS = (
    "policy.generation: the '{backend}' generation backend does not serve requests continuously, which {what} "
    "needs (the endpoint sends each request on its own); configure its asynchronous engine (rl-vllm: "
    "policy.generation.vllm_cfg.async_engine: true)"
)


def why_served(cfg: Any) -> str | None:
    """The setting that makes run config ``cfg`` serve the endpoint, or None when it does not."""
    generation = cfg.policy.generation
    if generation is not None and generation.expose_http_server:
        return "policy.generation.expose_http_server: is true"
    env = getattr(cfg, "env", None)
    if getattr(env, "name", None) == AGENT_ENVIRONMENT:
        return f"env.name: is '{AGENT_ENVIRONMENT}' (an agent environment serves the endpoint)"
    return None


def serving_problems(resolved: Any) -> list[str]:
    """The lines that refuse ``resolved`` (a ``ResolvedConfig``) because it serves the endpoint over a generation
    backend that cannot serve requests continuously; empty when it does not serve it or can."""
    from rlcore.chat.tool_calls import get_tool_call_parser
    from rlcore.environments.runner import is_agent_class
    from rlcore.plugins import BackendError, Capability

    why, problems = why_served(resolved.config), []
    environment = resolved.environment
    if why is None and environment is not None and is_agent_class(environment.spec.worker_class):
        why = f"env.name: is '{environment.spec.name}' (an agent environment serves the endpoint)"
    if why is None:
        return []
    if environment is not None and resolved.config.env.num_workers and why.startswith("env.name"):
        problems.append(
            f"env.num_workers: is {resolved.config.env.num_workers}, but an agent environment's episodes run in the "
            "driver beside the endpoint they talk to; set env.num_workers: 0"
        )
    generation = resolved.generation
    if generation is None or not generation.separate:
        name = resolved.config.policy.training_backend
        problems.append(f"{why}, but the '{name}' training backend generates itself, one batch at a time; {FIX}")
    elif not generation.spec.supports(Capability.ASYNC_ENGINE):
        problems.append(
            f"{why}, but the '{generation.spec.name}' generation backend does not declare 'async_engine' (it does "
            f"not serve requests continuously); {FIX}"
        )
    parser = resolved.config.policy.generation.tool_call_parser
    try:
        get_tool_call_parser(parser)
    except (BackendError, TypeError) as exc:
        problems.append(f"policy.generation.tool_call_parser: {exc}")
    return problems
