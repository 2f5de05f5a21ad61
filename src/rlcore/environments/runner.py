"""Runs the run's environment on a batch: in the driver, or split over Ray actors with a timeout.

One sample's failure costs that sample only: an environment that raises is
called again one sample at a time (:func:`isolated_step`), and the samples
of an actor that times out or dies get reward 0 with the reason while a new
actor takes its place. The in-driver environment has the same deadline
(``env.timeout_s``, :mod:`rlcore.environments.deadline`): at it, the batch's
samples get reward 0 and a new environment object takes the old one's place.
Each distinct exception is written once, with its count, to
``logs/environment_errors.log`` (:mod:`rlcore.environments.failures`).

A batch in which every sample failed is an error of the run (a wrong
``data.output_key`` or a broken environment), not noise to train on, and so
is one in which more than ``env.max_failure_fraction`` of the samples failed:
a failed sample scores 0, which a group-relative advantage reads as a wrong
answer, so beyond that share the batch teaches the failure more than the task.

A reward that is NaN or +-inf is such a failure too (``env.on_nonfinite_reward: zero``, the default: reward
0, counted in ``env/errors`` and ``env/nonfinite_rewards``), or stops the run naming the sample
(``fail``): one NaN reward in a batch would otherwise make the loss, and then every weight, NaN.
"""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path
from typing import Any

from rlcore.environments.deadline import StepTimedOut, call_with_deadline
from rlcore.environments.failures import FailureLog, SampleFailure, failure_of
from rlcore.environments.scoring import last_prompt, nonfinite_samples, zero_nonfinite
from rlcore.interfaces.environment import EnvironmentReturn, Message


class EnvironmentFailed(RuntimeError):
    """Every sample of a batch failed in the environment; the message names the first cause."""


def build_environment(env_class: str, section: Any) -> Any:
    """The environment object: ``Class(section)``."""
    from rlcore.plugins import import_object

    return import_object(env_class)(section)


def is_agent_class(env_class: str) -> bool:
    """Whether the environment class ``module:Class`` is an agent environment (it defines ``run_episode``); False
    for a class that cannot be imported (building it reports that)."""
    from rlcore.interfaces.agent import is_agent_environment
    from rlcore.plugins import import_object

    try:
        return is_agent_environment(import_object(env_class))
    except Exception:  # noqa: BLE001 - a missing module or class is the environment's own error, named where it is built
        return False


def _failed(metadata: list[dict[str, Any]], reason: str) -> EnvironmentReturn:
    return EnvironmentReturn.final([0.0] * len(metadata), metadata, errors=[reason] * len(metadata))


def _checked(result: Any, n: int) -> EnvironmentReturn:
    if not isinstance(result, EnvironmentReturn):
        raise TypeError(f"step returned {type(result).__name__}, not a rlcore.interfaces.environment.EnvironmentReturn")
    if len(result.rewards) != n:
        raise ValueError(f"step returned {len(result.rewards)} results for {n} samples")
    return result


def isolated_step(
    env: Any,
    message_logs: list[list[Message]],
    metadata: list[dict[str, Any]],
    failures: list[SampleFailure | None] | None = None,
) -> EnvironmentReturn:
    """``env.step`` on the batch; if it raises, on each sample alone (a sample that raises gets reward 0).
    ``failures``, when given, gets one entry per sample: where its exception was raised, or None."""
    failures = failures if failures is not None else []
    try:
        result = _checked(env.step(message_logs, metadata), len(message_logs))
        failures.extend([None] * len(message_logs))
        return result
    except Exception as exc:  # noqa: BLE001 - the environment's own bug, charged to the samples that trigger it
        if len(message_logs) == 1:
            failure = failure_of(exc)
            failures.append(failure)
            return _failed(metadata, failure.error)
    # outside the handler, so that a sample's traceback does not carry the batch's as its context
    return EnvironmentReturn.concat(
        [isolated_step(env, [log], [meta], failures) for log, meta in zip(message_logs, metadata)]
    )


class EnvironmentHost:
    """The body of an environment actor: one environment object, stepped with isolation."""

    def __init__(self, env_class: str, section: Any) -> None:
        self.env = build_environment(env_class, section)

    def step(self, message_logs: list[list[Message]], metadata: list[dict[str, Any]]) -> EnvironmentReturn:
        return isolated_step(self.env, message_logs, metadata)

    def step_with_failures(
        self, message_logs: list[list[Message]], metadata: list[dict[str, Any]]
    ) -> tuple[EnvironmentReturn, list[SampleFailure | None]]:
        failures: list[SampleFailure | None] = []
        return isolated_step(self.env, message_logs, metadata, failures), failures

    def tools(self) -> list[dict[str, Any]] | None:
        return getattr(self.env, "tools", None)

    def close(self) -> None:
        if hasattr(self.env, "close"):
            self.env.close()


class EnvironmentRunner:
    """The run's environment ``name``; ``num_workers`` = 0 runs it in the driver, N > 0 in N Ray actors.
    ``on_nonfinite_reward``: ``"zero"`` or ``"fail"`` (``env.on_nonfinite_reward``); ``max_failure_fraction``:
    the share of a batch's samples that may fail before the run stops; ``log_dir``: where
    ``environment_errors.log`` goes (none without it)."""

    def __init__(
        self,
        name: str,
        env_class: str,
        section: Any,
        num_workers: int = 0,
        timeout_s: float = 60.0,
        on_nonfinite_reward: str = "zero",
        max_failure_fraction: float = 0.5,
        log_dir: Path | None = None,
    ) -> None:
        if on_nonfinite_reward not in ("zero", "fail"):
            raise ValueError(f"env.on_nonfinite_reward: expected 'zero' or 'fail', got {on_nonfinite_reward!r}")
        if not 0.0 <= max_failure_fraction <= 1.0:
            raise ValueError(f"env.max_failure_fraction: expected a fraction from 0 to 1, got {max_failure_fraction}")
        self.name, self.env_class, self.section = name, env_class, section
        self.num_workers, self.timeout_s = num_workers, timeout_s
        self.on_nonfinite_reward, self.max_failure_fraction = on_nonfinite_reward, max_failure_fraction
        self.failure_log = FailureLog(name, log_dir)
        if num_workers and is_agent_class(env_class):
            raise ValueError(
                f"env.num_workers: is {num_workers}, but '{name}' is an agent environment, whose episodes run in the "
                "driver beside the endpoint they talk to (on 127.0.0.1, side by side on one event loop); set "
                "env.num_workers: 0"
            )
        self.local = build_environment(env_class, section) if num_workers == 0 else None
        self.actors = [self._new_actor() for _ in range(num_workers)]
        self._lock = threading.Lock()  # async GRPO's rollout thread and validation both step it

    @classmethod
    def from_resolved(cls, resolved_env: Any, env_cfg: Any, log_dir: Path | None = None) -> EnvironmentRunner:
        return cls(
            resolved_env.spec.name,
            resolved_env.spec.worker_class,
            resolved_env.section,
            env_cfg.num_workers,
            env_cfg.timeout_s,
            env_cfg.on_nonfinite_reward,
            env_cfg.max_failure_fraction,
            log_dir,
        )

    @property
    def agent_environment(self) -> Any:
        """The environment when it is an agent environment (built in the driver; rolled out by
        :func:`rlcore.run.agent_rollouts.run_agent_rollout`, never stepped), else None."""
        from rlcore.interfaces.agent import is_agent_environment

        return self.local if is_agent_environment(self.local) else None

    @property
    def tools(self) -> list[dict[str, Any]] | None:
        """The environment's tools (OpenAI function schemas, its ``tools`` attribute), which the run gives the chat
        template of the first prompt; None for an environment without tools."""
        if self.local is not None:
            return getattr(self.local, "tools", None)
        if not hasattr(self, "_actor_tools"):  # asked once: an actor's environment is built from the same section
            import ray

            self._actor_tools: list[dict[str, Any]] | None = ray.get(
                self.actors[0].tools.remote(), timeout=self.timeout_s
            )
        return self._actor_tools

    def _new_actor(self) -> Any:
        import ray

        # The actors reserve no CPU: the cluster's bundles hold the machine's CPUs for the workers.
        return ray.remote(EnvironmentHost).options(num_cpus=0, max_restarts=0).remote(self.env_class, self.section)

    def step(self, message_logs: list[list[Message]], metadata: list[dict[str, Any]]) -> EnvironmentReturn:
        """Every sample's result; raises :class:`EnvironmentFailed` when all of them, or more than
        ``max_failure_fraction`` of them, failed."""
        with self._lock:
            result, failures = (
                self._step_in_driver(message_logs, metadata)
                if self.local is not None
                else self._step_on_actors(message_logs, metadata)
            )
        self.failure_log.add([f for f in failures if f is not None])
        result = self._finite(result, message_logs)
        self._check_failures(result, failures)
        return result

    def _check_failures(self, result: EnvironmentReturn, failures: list[SampleFailure | None]) -> None:
        """:class:`EnvironmentFailed` naming the first failed sample's error (and where the user's code raised
        it) when every sample failed, or more than ``max_failure_fraction`` of them."""
        failed = [i for i, error in enumerate(result.errors) if error]
        n = len(result.errors)
        if not failed or (len(failed) < n and len(failed) <= self.max_failure_fraction * n):
            return
        first = failed[0]
        how_many = (
            f"all {n} samples failed"
            if len(failed) == n
            else f"{len(failed)} of {n} samples failed, more than env.max_failure_fraction "
            f"({self.max_failure_fraction:g}) allows"
        )
        where = ""
        if (failure := failures[first]) is not None:
            log = self.failure_log.written
            where = f" (at {failure.where}" + (f"; traceback in {log})" if log is not None else ")")
        raise EnvironmentFailed(f"environment '{self.name}': {how_many}; the first: {result.errors[first]}{where}")

    def _step_in_driver(
        self, message_logs: list[list[Message]], metadata: list[dict[str, Any]]
    ) -> tuple[EnvironmentReturn, list[SampleFailure | None]]:
        """The batch on the driver's environment, within ``timeout_s``; past it, the samples fail as an actor's
        do and the environment object is replaced. The late call may still hold the old one: it is closed all the
        same, so what it holds (a reward model's workers) is freed for the new one; the late call then fails,
        and nothing waits for it."""
        failures: list[SampleFailure | None] = []
        try:
            return call_with_deadline(
                lambda: isolated_step(self.local, message_logs, metadata, failures), self.timeout_s
            ), failures
        except StepTimedOut:
            reason = f"environment '{self.name}' timed out after {self.timeout_s:g}s in the driver (env.timeout_s)"
        timed_out = self.local
        if timed_out is not None and hasattr(timed_out, "close"):
            with contextlib.suppress(Exception):  # the timed-out environment's own failure is not the run's
                timed_out.close()
        self.local = build_environment(self.env_class, self.section)
        return _failed(metadata, reason), [None] * len(message_logs)

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
                "; env.on_nonfinite_reward: fail stops the run (zero, the default, scores such a sample 0)"
            )
        return zero_nonfinite(result, found, self.name) if found else result

    def _step_on_actors(
        self, message_logs: list[list[Message]], metadata: list[dict[str, Any]]
    ) -> tuple[EnvironmentReturn, list[SampleFailure | None]]:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        n = len(message_logs)
        bounds = [round(i * n / len(self.actors)) for i in range(len(self.actors) + 1)]
        chunks = [(i, bounds[i], bounds[i + 1]) for i in range(len(self.actors)) if bounds[i + 1] > bounds[i]]
        refs = [self.actors[i].step_with_failures.remote(message_logs[a:b], metadata[a:b]) for i, a, b in chunks]
        deadline = time.monotonic() + self.timeout_s
        parts: list[EnvironmentReturn] = []
        failures: list[SampleFailure | None] = []
        for (i, a, b), ref in zip(chunks, refs):
            try:
                part, part_failures = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
                parts.append(part)
                failures += part_failures
                continue
            except GetTimeoutError:
                reason = f"environment '{self.name}' actor {i} timed out after {self.timeout_s:g}s (env.timeout_s)"
            except RayActorError as exc:
                reason = f"environment '{self.name}' actor {i} died: {' '.join(str(exc).split())[:200]}"
            ray.kill(self.actors[i], no_restart=True)
            self.actors[i] = self._new_actor()
            parts.append(_failed(metadata[a:b], reason))
            failures += [None] * (b - a)
        return EnvironmentReturn.concat(parts), failures

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
