"""Runs the run's environment on a batch: in the driver, or split over Ray actors with a timeout.

One sample's failure costs that sample only: an environment that raises is
called again one sample at a time (:func:`isolated_step`), and the samples
of an actor that times out or dies get reward 0 with the reason while a new
actor takes its place. A batch in which every sample failed is an error of
the run (a wrong ``data.output_key`` or a broken environment), not noise to
train on.

A reward that is NaN or +-inf is such a failure too (``env.on_nonfinite_reward: zero``, the default: reward
0, counted in ``env/errors`` and ``env/nonfinite_rewards``), or stops the run naming the sample
(``fail``): one NaN reward in a batch would otherwise make the loss, and then every weight, NaN.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from rlcore.environments.scoring import last_prompt, nonfinite_samples, zero_nonfinite
from rlcore.interfaces.environment import EnvironmentReturn, Message


class EnvironmentFailed(RuntimeError):
    """Every sample of a batch failed in the environment; the message names the first cause."""


def build_environment(env_class: str, section: Any) -> Any:
    """The environment object: ``Class(section)``."""
    from rlcore.plugins import import_object

    return import_object(env_class)(section)


def _failed(metadata: list[dict[str, Any]], reason: str) -> EnvironmentReturn:
    return EnvironmentReturn.final([0.0] * len(metadata), metadata, errors=[reason] * len(metadata))


def _checked(result: Any, n: int) -> EnvironmentReturn:
    if not isinstance(result, EnvironmentReturn):
        raise TypeError(f"step returned {type(result).__name__}, not a rlcore.interfaces.environment.EnvironmentReturn")
    if len(result.rewards) != n:
        raise ValueError(f"step returned {len(result.rewards)} results for {n} samples")
    return result


def isolated_step(env: Any, message_logs: list[list[Message]], metadata: list[dict[str, Any]]) -> EnvironmentReturn:
    """``env.step`` on the batch; if it raises, on each sample alone (a sample that raises gets reward 0)."""
    try:
        return _checked(env.step(message_logs, metadata), len(message_logs))
    except Exception as exc:  # noqa: BLE001 - the environment's own bug, charged to the samples that trigger it
        if len(message_logs) == 1:
            return _failed(metadata, f"{type(exc).__name__}: {' '.join(str(exc).split())}")
        return EnvironmentReturn.concat([isolated_step(env, [log], [meta])
                                         for log, meta in zip(message_logs, metadata)])


class EnvironmentHost:
    """The body of an environment actor: one environment object, stepped with isolation."""

    def __init__(self, env_class: str, section: Any) -> None:
        self.env = build_environment(env_class, section)

    def step(self, message_logs: list[list[Message]], metadata: list[dict[str, Any]]) -> EnvironmentReturn:
        return isolated_step(self.env, message_logs, metadata)

    def close(self) -> None:
        if hasattr(self.env, "close"):
            self.env.close()


class EnvironmentRunner:
    """The run's environment ``name``; ``num_workers`` = 0 runs it in the driver, N > 0 in N Ray actors.
    ``on_nonfinite_reward``: ``"zero"`` or ``"fail"`` (``env.on_nonfinite_reward``)."""

    def __init__(self, name: str, env_class: str, section: Any, num_workers: int = 0, timeout_s: float = 60.0,
                 on_nonfinite_reward: str = "zero") -> None:
        if on_nonfinite_reward not in ("zero", "fail"):
            raise ValueError(f"env.on_nonfinite_reward: expected 'zero' or 'fail', got {on_nonfinite_reward!r}")
        self.name, self.env_class, self.section = name, env_class, section
        self.num_workers, self.timeout_s = num_workers, timeout_s
        self.on_nonfinite_reward = on_nonfinite_reward
        self.local = build_environment(env_class, section) if num_workers == 0 else None
        self.actors = [self._new_actor() for _ in range(num_workers)]
        self._lock = threading.Lock()  # async GRPO's rollout thread and validation both step it

    @classmethod
    def from_resolved(cls, resolved_env: Any, env_cfg: Any) -> "EnvironmentRunner":
        return cls(resolved_env.spec.name, resolved_env.spec.worker_class, resolved_env.section,
                   env_cfg.num_workers, env_cfg.timeout_s, env_cfg.on_nonfinite_reward)

    def _new_actor(self) -> Any:
        import ray

        # The actors reserve no CPU: the cluster's bundles hold the machine's CPUs for the workers.
        return ray.remote(EnvironmentHost).options(num_cpus=0, max_restarts=0).remote(self.env_class, self.section)

    def step(self, message_logs: list[list[Message]], metadata: list[dict[str, Any]]) -> EnvironmentReturn:
        """Every sample's result; raises :class:`EnvironmentFailed` when all of them failed."""
        with self._lock:
            result = (isolated_step(self.local, message_logs, metadata) if self.local is not None
                      else self._step_on_actors(message_logs, metadata))
        result = self._finite(result, message_logs)
        errors = [e for e in result.errors if e]
        if errors and len(errors) == len(result.errors):
            raise EnvironmentFailed(f"environment '{self.name}': all {len(errors)} samples failed; the first: "
                                    f"{errors[0]}")
        return result

    def _finite(self, result: EnvironmentReturn, message_logs: list[list[Message]]) -> EnvironmentReturn:
        """``result`` with its NaN / +-inf rewards failed (reward 0), or :class:`EnvironmentFailed` naming the
        first such sample under ``fail``."""
        found = nonfinite_samples(result)
        if found and self.on_nonfinite_reward == "fail":
            i, what = found[0]
            prompt = " ".join(last_prompt(message_logs[i]).split())
            prompt = prompt if len(prompt) <= 60 else prompt[:57] + "..."
            raise EnvironmentFailed(
                f"environment '{self.name}' returned a non-finite reward ({what}) for sample {i} of a batch of "
                f"{len(message_logs)} (prompt {prompt!r}){f'; {len(found)} such samples' if len(found) > 1 else ''}"
                "; env.on_nonfinite_reward: fail stops the run (zero, the default, scores such a sample 0)")
        return zero_nonfinite(result, found, self.name) if found else result

    def _step_on_actors(self, message_logs: list[list[Message]], metadata: list[dict[str, Any]]) -> EnvironmentReturn:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        n = len(message_logs)
        bounds = [round(i * n / len(self.actors)) for i in range(len(self.actors) + 1)]
        chunks = [(i, bounds[i], bounds[i + 1]) for i in range(len(self.actors)) if bounds[i + 1] > bounds[i]]
        refs = [self.actors[i].step.remote(message_logs[a:b], metadata[a:b]) for i, a, b in chunks]
        deadline = time.monotonic() + self.timeout_s
        parts = []
        for (i, a, b), ref in zip(chunks, refs):
            try:
                parts.append(ray.get(ref, timeout=max(0.0, deadline - time.monotonic())))
                continue
            except GetTimeoutError:
                reason = f"environment '{self.name}' actor {i} timed out after {self.timeout_s:g}s (env.timeout_s)"
            except RayActorError as exc:
                reason = f"environment '{self.name}' actor {i} died: {' '.join(str(exc).split())[:200]}"
            ray.kill(self.actors[i], no_restart=True)
            self.actors[i] = self._new_actor()
            parts.append(_failed(metadata[a:b], reason))
        return EnvironmentReturn.concat(parts)

    def shutdown(self) -> None:
        """Release the environment (and kill its actors)."""
        if self.local is not None and hasattr(self.local, "close"):
            self.local.close()
        if self.actors:
            import ray

            for actor in self.actors:
                try:
                    ray.get(actor.close.remote(), timeout=10)
                except Exception:  # noqa: BLE001 - it is killed next anyway
                    pass
                ray.kill(actor, no_restart=True)
            self.actors = []
