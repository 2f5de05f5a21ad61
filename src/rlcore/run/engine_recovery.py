"""A generation engine that dies is restarted, and the run goes on.

When an engine process dies (killed, out of memory) during generation or a refit, the run starts the
generation backend again on the same placement (engine ``r`` in bundle ``r`` of the same placement group),
refits the policy's current weights into it, and redoes the call that was lost: the generation of that turn's
rollouts, or the refit. ``policy.generation.engine_restarts_per_step`` bounds the restarts of one step (0:
the first death stops the run, as before). Fatal, with the death's one line: a second death past that
bound, a placement whose node is gone, a restart that fails, and the death of anything else (a training rank).

Generic: the backend is started again through its driver class's constructor, the plugin API's own entry;
an engine is recognised as one of the Ray actors of the driver's ``worker_group``
(:class:`rlcore.distributed.RayWorkerGroup`, the documented way to start engines). A driver without one is
not restarted. The run reaches the engines through :class:`RestartingGeneration` and
:class:`RestartingSynchronizer`, which stand in for the backend and the synchronizer, so every rollout
algorithm (GRPO, distillation, a third party's) gets this without a change.

The whole backend is replaced, never one rank: an engine of several ranks (vLLM's tensor_parallel_size N is N
actors meeting in a torch.distributed group of their own) whose rank died has its other ranks stuck in a dead
group, so they are stopped with it and the group is made anew. The new engines hold the checkpoint's weights,
not the policy's: until their refit lands, :class:`RestartingGeneration` refuses to generate on them
(:class:`EnginesNotRefitError`), also when that refit failed.

Engines on their own resources take their weights by collective broadcast: the new synchronizer builds a new
refit group, which training rank 0 joins in place of the old one. Asynchronous GRPO calls the engines from two
threads (the rollout thread generates while the main thread refits): one lock makes a restart, its refit and
every refit atomic, and a call that finds only engines already replaced dead (the other thread restarted them)
is simply redone on the new engines instead of counting as a second death.

The engine lifecycle ('async_engine') under a restart: ``as_completed`` over :class:`PendingGeneration` handles
yields each output as it finishes, and a handle whose engines died (or were replaced) is submitted again to the
new ones and yielded when that finishes, as ``collect`` redoes its call. ``pause_generation`` and
``resume_generation`` go to the current backend under the lock (no restart in the middle of one), and are redone
on new engines if theirs die; engines started while the run has them paused are paused before anything is
submitted to them, so a pause the caller holds (to refit) stays true across a restart.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlcore.interfaces.generation import PauseMode

from rlcore.run.errors import RunError

SETTING = "policy.generation.engine_restarts_per_step"


def dead_actor_ids(exc: BaseException) -> set[str]:
    """Ids (hex) of the Ray actors whose death ``exc`` reports, along its chain of causes (an error raised while
    another was handled is not caused by it)."""
    from ray.exceptions import RayActorError

    ids: set[str] = set()
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, RayActorError) and getattr(current, "actor_id", None):
            ids.add(str(current.actor_id))
        pending.append(
            current.__cause__ if current.__cause__ is not None or current.__suppress_context__ else current.__context__
        )
    return ids


def engine_actor_ids(generation: Any) -> set[str]:
    """Ids (hex) of the engine actors of a generation driver that keeps them in ``worker_group``; empty
    for a driver that does not (its engines are not recognised, so not restarted)."""
    group = getattr(generation, "worker_group", None)
    workers = getattr(group, "workers", None) or []
    return {w._actor_id.hex() for w in workers if hasattr(w, "_actor_id")}


def first_line(exc: BaseException) -> str:
    """The error's first line as ``rlcore run`` prints it (a worker's error names itself; others their type)."""
    from rlcore.distributed import WorkerError

    text = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
    return text if isinstance(exc, (WorkerError, RunError)) else f"{type(exc).__name__}: {text}"


def lost_nodes(cluster: Any) -> list[str]:
    """``bundle i on node X`` for each bundle of ``cluster`` whose node Ray no longer counts alive."""
    import ray

    alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    return [
        f"bundle {b.index} on node {b.node_ip} ({b.node_id[:8]})"
        for b in cluster.bundles()
        if b.node_id and b.node_id not in alive
    ]


class EngineRecovery:
    """Holds the run's current generation backend and synchronizer, and replaces both when an engine dies.

    ``start()`` builds a new ``(generation, synchronizer)`` pair on ``cluster`` (the generation placement);
    ``policy`` is refit into the new engines. ``restarts`` counts every restart of the run (the metric
    ``engine/restarts``); :meth:`end_step` starts the next step's allowance. ``awake``: the engines stay awake
    for the whole run (asynchronous GRPO), so a new backend is woken as soon as it starts. ``lock`` is held by
    whoever restarts and refits.
    """

    def __init__(
        self,
        start: Callable[[], tuple[Any, Any]],
        cluster: Any,
        policy: Any,
        restarts_per_step: int,
        generation: Any,
        synchronizer: Any,
        awake: bool = False,
    ) -> None:
        self.start, self.cluster, self.policy = start, cluster, policy
        self.restarts_per_step, self.awake = restarts_per_step, awake
        self.generation, self.synchronizer = generation, synchronizer
        self.engines = engine_actor_ids(generation)
        self.retired: set[str] = set()  # the engines of backends this run replaced
        self.restarts = 0
        self.in_step = 0
        self.unrefit = False  # restarted, and not refit since: the engines hold the checkpoint's weights
        self.paused: PauseMode | None = None  # the mode of the pause the run holds (pause_generation), if any
        self.lock = threading.RLock()

    def end_step(self) -> dict[str, float]:
        """The metrics of the step that ended (``engine/restarts``: the run's restarts so far)."""
        with self.lock:
            self.in_step = 0
            return {"engine/restarts": float(self.restarts)}

    def recover(self, exc: Exception) -> bool:
        """After ``exc`` ended a call: True when the engines were restarted here (the caller refits them), False
        when only engines replaced already died (the other thread restarted them: the caller redoes its call);
        otherwise raise (the error itself, or a :class:`RunError` saying in one line why no restart).

        The dead are read along the error's chain, which may also name engines an earlier restart replaced."""
        with self.lock:
            dead = dead_actor_ids(exc)
            if not dead or not dead <= self.engines | self.retired or self.restarts_per_step == 0:
                raise exc  # not an engine's death (a training rank's, a bug), or restarts are off: as before
            if not dead & self.engines:
                return False  # its engines were replaced while it ran: redo it on the new ones
            why = self._not_restorable()
            if why:
                raise RunError(f"{first_line(exc)}; not restarted: {why}") from exc
            print(
                f"engine restart: {first_line(exc)}; restarting the generation engines on the same placement "
                f"({self.in_step + 1} of {SETTING}={self.restarts_per_step} this step)",
                file=sys.stderr,
            )
            self.in_step += 1
            self._restart(exc)
            return True

    def _not_restorable(self) -> str:
        if self.in_step >= self.restarts_per_step:
            return f"it died again after {self.in_step} restart(s) in this step ({SETTING}={self.restarts_per_step})"
        if lost := lost_nodes(self.cluster):
            return f"its placement cannot be restored ({', '.join(lost)} is gone)"
        return ""

    def _restart(self, cause: Exception) -> None:
        """Stop what is left of the old backend and start a new one on the same bundles (not refit yet)."""
        import contextlib

        for old in (self.synchronizer, self.generation):
            with contextlib.suppress(Exception):  # the dead engines' error is the one that matters
                old.shutdown()
        self.retired |= self.engines
        try:
            self.generation, self.synchronizer = self.start()
            if self.awake:
                self.generation.prepare_for_generation()
            if self.paused is not None:  # the run holds its engines paused (to refit): so are the new ones
                self.generation.pause_generation(self.paused)
        except Exception as exc:  # noqa: BLE001 - one line naming both deaths
            raise RunError(f"{first_line(cause)}; restarting the engines failed: {first_line(exc)}") from exc
        self.engines = engine_actor_ids(self.generation)
        self.restarts += 1
        self.unrefit = True

    def check_refit(self) -> None:
        """Raise :class:`EnginesNotRefitError` while the engines of the last restart have not been refit."""
        if self.unrefit:
            raise EnginesNotRefitError(
                f"the generation engines have not been refit since they were restarted (restart {self.restarts} "
                "of this run): they hold the checkpoint's weights, not the policy's; refit them (the run's "
                "synchronizer's sync_weights) before generating"
            )

    def refit_and_wake(self, wake: bool) -> None:
        """As at a step's start: the current weights into the new engines, then (to generate) wake them."""
        from rlcore.run.step import refit

        with self.lock:
            refit(self.policy, RestartingSynchronizer(self))  # a death here counts too
            if wake and not self.awake:
                RestartingGeneration(self).prepare_for_generation()  # a death here counts too


class EnginesNotRefitError(RuntimeError):
    """A generation asked of engines a restart started and no refit has fed yet."""


class RestartingSynchronizer:
    """Stands in for the run's :class:`rlcore.refit.WeightSynchronizer`: a refit an engine's death broke is
    done again into restarted engines (:class:`EngineRecovery`)."""

    def __init__(self, recovery: EngineRecovery) -> None:
        self._recovery = recovery

    @property
    def stale(self) -> bool:
        return self._recovery.synchronizer.stale

    @stale.setter
    def stale(self, value: bool) -> None:
        self._recovery.synchronizer.stale = value

    def sync_weights(self) -> dict[str, float]:
        recovery = self._recovery
        with recovery.lock:  # no restart by the other thread in the middle of a refit
            while True:
                try:
                    stats = recovery.synchronizer.sync_weights()
                    recovery.unrefit = False
                    return stats
                except Exception as exc:  # noqa: BLE001 - re-raised unless an engine died and was restarted
                    recovery.recover(exc)  # restarted: the refit is done again, into the new engines

    def __getattr__(self, name: str) -> Any:
        return getattr(self._recovery.synchronizer, name)


@dataclass
class PendingGeneration:
    """A :meth:`RestartingGeneration.generate_async` under way: what was asked, and of which backend."""

    data: Any
    greedy: bool
    backend: Any
    handle: Any


class RestartingGeneration:
    """Stands in for the run's generation backend: a call an engine's death lost is done again on restarted,
    refit engines (:class:`EngineRecovery`); everything else goes to the current backend."""

    def __init__(self, recovery: EngineRecovery) -> None:
        self._recovery = recovery

    def generate(self, data: Any, greedy: bool = False) -> Any:
        with self._recovery.lock:
            self._recovery.check_refit()
            return self._retried(lambda g: g.generate(data, greedy=greedy), wake=True)

    def generate_async(self, data: Any, greedy: bool = False) -> PendingGeneration:
        with self._recovery.lock:  # never submitted to engines a restart has not refit yet
            self._recovery.check_refit()
            while True:
                backend = self._recovery.generation
                try:  # submitting may call the engines (vLLM's asks them whether the last refit landed)
                    return PendingGeneration(data, greedy, backend, backend.generate_async(data, greedy))
                except Exception as exc:  # noqa: BLE001 - re-raised unless an engine died and was restarted
                    self._recover(exc, wake=True)

    def generate_groups_async(self, batches: Sequence[Any], greedy: bool = False) -> list[PendingGeneration]:
        """Several sample groups at once, through the backend's ``generate_groups_async`` where it has one (else a
        ``generate_async`` each); a handle per batch, each done again on its own if an engine died meanwhile."""
        with self._recovery.lock:
            self._recovery.check_refit()
            while True:
                backend = self._recovery.generation
                together = getattr(backend, "generate_groups_async", None)
                try:
                    if together is None:
                        handles = [backend.generate_async(batch, greedy) for batch in batches]
                    else:
                        handles = together(batches, greedy=greedy)
                    return [PendingGeneration(b, greedy, backend, h) for b, h in zip(batches, handles)]
                except Exception as exc:  # noqa: BLE001 - re-raised unless an engine died and was restarted
                    self._recover(exc, wake=True)

    def collect(self, pending: PendingGeneration) -> Any:
        """The output of :meth:`generate_async`; if an engine died meanwhile, generated again on new engines."""
        while True:
            try:
                return pending.backend.collect(pending.handle)
            except Exception as exc:  # noqa: BLE001 - re-raised unless an engine died and was restarted
                self._recover(exc, wake=True)
            pending = self.generate_async(pending.data, pending.greedy)

    def as_completed(
        self, handles: Sequence[PendingGeneration], timeout_s: float | None = None
    ) -> Iterator[tuple[int, Any]]:
        """``(index, output)`` of each of ``handles`` as it finishes (the backend's ``as_completed``); a handle
        whose engines died, or were replaced meanwhile, is generated again on the new engines, like ``collect``."""
        remaining = dict(enumerate(handles))
        while remaining:
            backend = self._recovery.generation
            for index, pending in list(remaining.items()):
                if pending.backend is not backend:  # submitted to engines a restart replaced: submit it again
                    remaining[index] = self.generate_async(pending.data, pending.greedy)
            if any(pending.backend is not self._recovery.generation for pending in remaining.values()):
                continue  # a restart while submitting again: resubmit to the newest engines
            order = list(remaining)
            results = iter(backend.as_completed([remaining[i].handle for i in order], timeout_s))
            try:
                while True:
                    try:
                        position, output = next(results)
                    except StopIteration:
                        break
                    except Exception as exc:  # noqa: BLE001 - re-raised unless an engine died and was restarted
                        self._recover(exc, wake=True)
                        break  # the ones not yielded yet are submitted again to the new engines
                    index = order[position]
                    del remaining[index]
                    yield index, output
            finally:
                close = getattr(results, "close", None)
                if close is not None:
                    close()

    @property
    def continuous_serving(self) -> bool:
        """The current backend's (a restart starts the same driver with the same config, so it does not change)."""
        from rlcore.interfaces.generation import serves_continuously

        return serves_continuously(self._recovery.generation)

    def pause_generation(self, mode: PauseMode = "wait", timeout_s: float | None = None) -> None:
        """Pause the current engines; engines a restart starts before :meth:`resume_generation` start paused."""
        with self._recovery.lock:
            self._retried(lambda g: g.pause_generation(mode, timeout_s), wake=False)
            self._recovery.paused = mode

    def resume_generation(self, recompute_kv_cache: bool = False) -> None:
        with self._recovery.lock:
            self._retried(lambda g: g.resume_generation(recompute_kv_cache), wake=False)
            self._recovery.paused = None

    def prepare_for_generation(self, *args: Any, **kwargs: Any) -> bool:
        return self._retried(lambda g: g.prepare_for_generation(*args, **kwargs), wake=False)

    def finish_generation(self, *args: Any, **kwargs: Any) -> bool:
        return self._retried(lambda g: g.finish_generation(*args, **kwargs), wake=False)

    def set_weight_version(self, version: int) -> None:
        return self._retried(lambda g: g.set_weight_version(version), wake=False)

    def _retried(self, call: Callable[[Any], Any], wake: bool) -> Any:
        with self._recovery.lock:  # calls of one thread at a time (asynchronous GRPO generates with collect)
            while True:
                try:
                    return call(self._recovery.generation)
                except Exception as exc:  # noqa: BLE001 - re-raised unless an engine died and was restarted
                    self._recover(exc, wake)

    def _recover(self, exc: Exception, wake: bool) -> None:
        with self._recovery.lock:
            if self._recovery.recover(exc):
                self._recovery.refit_and_wake(wake)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._recovery.generation, name)


def with_restarts(run: Any, start: Callable[[], tuple[Any, Any]], cluster: Any, restarts_per_step: int) -> None:
    """Put the run's generation backend and synchronizer behind an :class:`EngineRecovery` (``run.engines``),
    ``start`` building a new pair on ``cluster``."""
    recovery = EngineRecovery(
        start,
        cluster,
        run.policy,
        restarts_per_step,
        run.generation,
        run.synchronizer,
        awake=run.resolved.async_generation,
    )
    run.engines = recovery
    run.generation, run.synchronizer = RestartingGeneration(recovery), RestartingSynchronizer(recovery)
