"""Validation: greedy completions of the validation samples, scored by the run's environment.

When (NeMo-RL's settings): ``grpo.val_at_start`` validates the initial weights
before the first step (a fresh run only; its row in ``metrics.jsonl`` has
step -1); ``grpo.val_period`` = N validates after every N-th step, and
``grpo.val_at_end`` after the last one. A validation after step ``s`` sees the
weights step ``s`` produced, and its metrics (``validation/accuracy``: the
mean reward, which is the accuracy for a 0/1 environment) join step ``s``'s row.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rlcore.interfaces.agent import agent_of
from rlcore.run.rollouts import Rollout, run_rollout
from rlcore.run.step import Timer, loop_setting, refit

if TYPE_CHECKING:
    from rlcore.interfaces.agent import AgentEnvironment
    from rlcore.run.build import Run


def validation_due(run: Run, step: int) -> bool:
    """Whether a validation follows training step ``step``."""
    period, at_end = loop_setting(run.cfg, "val_period", 0), loop_setting(run.cfg, "val_at_end", False)
    return bool(run.data.validation) and (
        (period > 0 and (step + 1) % period == 0) or (at_end and step == run.num_steps - 1)
    )


def synchronous_generate(run: Run) -> Callable[[Any], Any]:
    """Greedy generation with the current policy weights (refit first when the engines are stale)."""

    def generate(batch: Any) -> Any:
        if run.synchronizer is not None and run.synchronizer.stale:
            refit(run.policy, run.synchronizer)
        run.generation.prepare_for_generation()
        try:
            return run.generation.generate(batch, greedy=True)
        finally:
            run.generation.finish_generation()

    return generate


def validate(run: Run, generate: Callable[[Any], Any]) -> dict[str, float]:
    """Roll out every validation sample greedily (``grpo.val_batch_size`` at a time, over
    ``grpo.max_rollout_turns`` turns), score, and summarise."""
    import torch

    cfg = run.cfg
    started = time.perf_counter()
    samples = run.data.validation or []
    size = loop_setting(cfg, "val_batch_size", len(samples) or 1)
    rewards, lengths, errors = [], [], 0.0
    for begin in range(0, len(samples), size):
        batch = samples[begin : begin + size]
        if (agent := agent_of(run.environment)) is not None:
            rollout = _agent_rollout(run, agent, batch)
        else:
            rollout = run_rollout(cfg, generate, run.environment, run.tokenizer, batch, 1, Timer())
        rewards.append(rollout.rewards)
        lengths.append(rollout.data["generation_lengths"].float())
        errors += float(rollout.metrics["env/errors"])
    all_rewards = torch.cat(rewards)
    return {
        "validation/accuracy": float(all_rewards.mean()),
        "validation/mean_generation_length": float(torch.cat(lengths).mean()),
        "validation/num_samples": float(all_rewards.numel()),
        "validation/env_errors": errors,
        "time/validation_s": time.perf_counter() - started,
    }


def _agent_rollout(run: Run, agent: AgentEnvironment, samples: list[Any]) -> Rollout:
    """Greedy episodes of the run's agent environment over the endpoint, with the current policy weights."""
    from rlcore.run.agent_rollouts import run_agent_rollout

    if run.synchronizer is not None and run.synchronizer.stale:
        refit(run.policy, run.synchronizer)
    run.generation.prepare_for_generation()
    try:
        return run_agent_rollout(run.cfg, run.generation, agent, run.tokenizer, samples, 1, Timer(), greedy=True)
    finally:
        run.generation.finish_generation()
