"""``RayWorkerGroup``: one Ray actor per rank, and the ways to call them.

Dispatch primitives (``method`` is a worker method's name, or the method of the worker Protocol it
implements, e.g. ``TrainingWorker.train`` from :mod:`rlcore.interfaces.workers`):

- :meth:`run_all_workers_single_data`: every worker gets the same arguments.
- :meth:`run_all_workers_multiple_data`: worker ``i`` gets ``data[i]``.
- :meth:`run_all_workers_sharded_data`: data is split along ``dp``; workers
  that share a dp index (tp/cp/pp peers) get the same shard; results are read
  from coordinate 0 of the replicated axes (one per dp index, in dp order).
- :meth:`run_streaming_on_worker`: a generator method on one rank, its items taken one at a time as the
  worker yields them (:meth:`next_item`), e.g. each sample group of one engine call as it finishes.

:meth:`get_results` waits on calls as they finish: the first failure (an
exception, or a dead process: killed, OOM) is raised at once as a
:class:`WorkerError` naming the worker, its rank and the cause, and the group's
remaining actors are killed, since their peers may be blocked in a collective
waiting for the dead rank. A failed group refuses further calls. Groups of
independent workers (``kill_on_error=False``) survive an exception raised by a
worker; a dead worker is fatal to every group.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rlcore.distributed.named_sharding import NamedSharding
from rlcore.distributed.virtual_cluster import RayVirtualCluster
from rlcore.distributed.worker_host import WORKER_LOG_DIR_ENV

#: Seconds a worker group waits for its workers' own ``shutdown`` before killing them.
SHUTDOWN_GRACE_S = 10.0

#: A worker method: its name, or the Protocol method it implements (the name is what crosses to the worker).
Method = str | Callable[..., Any]


def method_name(method: Method) -> str:
    return method if isinstance(method, str) else method.__name__


class WorkerError(RuntimeError):
    """A worker raised or died; names the worker, its rank and the cause."""

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


@dataclass
class Calls:
    """Futures of one dispatch: one per rank in ``ranks``.

    ``output_ranks`` (default: all) are the ranks whose results are returned;
    the others are still waited on, so a failure anywhere surfaces.
    """

    refs: list[Any]
    ranks: list[int]
    output_ranks: list[int] | None = None


@dataclass(eq=False)
class Stream:
    """One streaming call on one rank: the items the worker's generator method yields, in that order.

    ``generator`` is Ray's ``ObjectRefGenerator``, which ``ray.wait`` takes beside object refs (ready when
    its next item is, or when it ended); take the items with :meth:`RayWorkerGroup.next_item`."""

    generator: Any
    rank: int


def _task_error(exc: Any) -> str:
    """``Type: message [File ..., line ...]`` of the user exception inside a Ray task error."""
    cause = exc.cause if getattr(exc, "cause", None) is not None else exc
    lines = str(exc).strip().splitlines()
    where = next((ln.strip() for ln in reversed(lines) if ln.strip().startswith("File ")), "")
    return f"{type(cause).__name__}: {cause}" + (f" [{where}]" if where else "")


class RayWorkerGroup:
    """Starts ``cluster.world_size`` workers of ``worker_class`` in the cluster's bundles.

    Each is built as ``Class(*init_args, **init_kwargs, **offered)``, ``offered`` being the entries of
    ``offered_kwargs`` its constructor declares (a plugin's worker, given what it knows); a class lacking a
    method of one of ``capabilities`` is refused before it is built (:class:`WorkerHost`).
    """

    def __init__(
        self,
        cluster: RayVirtualCluster,
        worker_class: str,
        *,
        sharding: NamedSharding,
        name_prefix: str = "worker",
        init_args: tuple = (),
        init_kwargs: dict[str, Any] | None = None,
        offered_kwargs: dict[str, Any] | None = None,
        capabilities: Sequence[str] = (),
        extra_env: dict[str, str] | None = None,
        kill_on_error: bool = True,
        max_concurrency: int = 1,
    ) -> None:
        import ray

        from rlcore.distributed.worker_host import WorkerHost

        if sharding.world_size != cluster.world_size:
            raise ValueError(
                f"sharding {sharding} has {sharding.world_size} ranks but the cluster has {cluster.world_size} bundles"
            )
        self.cluster = cluster
        self.sharding = sharding
        self.name_prefix = name_prefix
        # Training ranks share collectives: after one raises, its peers may hang, so the group
        # is killed. Independent workers (e.g. generation engines) can survive an exception.
        self.kill_on_error = kill_on_error
        self._failure: WorkerError | None = None
        master_addr, master_port = cluster.get_master_address_and_port()
        host_cls = ray.remote(WorkerHost)
        self.workers: list[Any] = []
        self.worker_names: list[str] = []
        self.worker_nodes: list[str] = []  # "address (node id)": where each rank runs, for error messages
        for bundle in cluster.bundles():
            rank = bundle.index
            env = {
                "RANK": str(rank),
                "WORLD_SIZE": str(cluster.world_size),
                "LOCAL_RANK": str(bundle.local_rank),
                "MASTER_ADDR": master_addr,
                "MASTER_PORT": str(master_port),
                # A CPU cluster's workers must not pick up a GPU the host happens to have.
                **(
                    {}
                    if cluster.use_gpus
                    else {"RLCORE_CPU_THREADS": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
                ),
                **(extra_env or {}),
            }
            name = f"{name_prefix}-rank{rank}"
            env["RLCORE_WORKER_NAME"] = name
            if WORKER_LOG_DIR_ENV in os.environ:  # a quiet run: the worker logs to a file of its own
                env[WORKER_LOG_DIR_ENV] = os.environ[WORKER_LOG_DIR_ENV]
            actor = host_cls.options(
                scheduling_strategy=cluster.scheduling_strategy(rank),
                max_concurrency=max_concurrency,  # > 1: calls run in threads of their own (a serving engine)
                max_restarts=0,
                **cluster.actor_resources(),
            ).remote(worker_class, env, init_args, init_kwargs or {}, offered_kwargs, tuple(map(str, capabilities)))
            self.workers.append(actor)
            self.worker_names.append(name)
            self.worker_nodes.append(f"{bundle.node_ip} ({bundle.node_id[:8]})")

    @property
    def world_size(self) -> int:
        return self.sharding.world_size

    # -- dispatch -------------------------------------------------------------
    def _call(self, rank: int, method: Method, *args: Any, **kwargs: Any) -> Any:
        self._check_usable()
        return self.workers[rank].call.remote(method_name(method), *args, **kwargs)

    def _check_usable(self) -> None:
        if self._failure is not None:
            raise WorkerError(
                f"worker group '{self.name_prefix}' is unusable after an earlier failure: {self._failure}",
                self._failure.rank,
            )
        if not self.workers:
            raise WorkerError(f"worker group '{self.name_prefix}' has been shut down")

    def run_on_worker(self, rank: int, method: Method, *args: Any, **kwargs: Any) -> Calls:
        """One call on one rank (e.g. the serving engine with the least work outstanding)."""
        return Calls([self._call(rank, method, *args, **kwargs)], [rank])

    def run_streaming_on_worker(self, rank: int, method: Method, *args: Any, **kwargs: Any) -> Stream:
        """A generator method of the worker on one rank (through :meth:`WorkerHost.stream`); each item it
        yields can be taken as soon as it is yielded, while the call goes on (:meth:`next_item`)."""
        self._check_usable()
        generator = (
            self.workers[rank].stream.options(num_returns="streaming").remote(method_name(method), *args, **kwargs)
        )
        return Stream(generator, rank)

    def next_item(self, stream: Stream, timeout_s: float | None = None) -> Any:
        """The stream's next item, waiting up to ``timeout_s`` (``TimeoutError``); ``StopIteration`` once the
        worker's generator has returned. A failure is raised as :meth:`get_results` raises it: a
        :class:`WorkerError` naming the worker (a dead worker, or any failure in a ``kill_on_error`` group,
        fails the group)."""
        import ray

        ready, _ = ray.wait([stream.generator], num_returns=1, timeout=timeout_s)
        if not ready:
            raise TimeoutError(f"worker group '{self.name_prefix}': no item within {timeout_s}s")
        ref = next(stream.generator)  # StopIteration when it ended
        try:
            return ray.get(ref)
        except Exception as exc:  # noqa: BLE001 - re-raised with the worker named
            error = self.describe(stream.rank, exc)
            if not self.kill_on_error and not isinstance(exc, ray.exceptions.RayActorError):
                raise error from exc
            raise self._fail(error) from exc

    def run_all_workers_single_data(self, method: Method, *args: Any, **kwargs: Any) -> Calls:
        ranks = list(range(self.world_size))
        return Calls([self._call(r, method, *args, **kwargs) for r in ranks], ranks)

    def run_all_workers_multiple_data(self, method: Method, data: Sequence[Any], **kwargs: Any) -> Calls:
        if len(data) != self.world_size:
            raise ValueError(f"{method_name(method)}: got {len(data)} inputs for {self.world_size} workers")
        ranks = list(range(self.world_size))
        return Calls([self._call(r, method, d, **kwargs) for r, d in zip(ranks, data)], ranks)

    def run_all_workers_sharded_data(self, method: Method, shards: Sequence[Any], **kwargs: Any) -> Calls:
        """Shard ``i`` goes to every rank with dp index ``i``; returns only the output ranks' calls."""
        import ray

        if len(shards) != self.sharding.dp:
            raise ValueError(f"{method_name(method)}: got {len(shards)} shards for dp={self.sharding.dp}")
        shard_refs = [ray.put(s) for s in shards]  # one copy per shard, not per rank
        ranks = list(range(self.world_size))
        refs = [self._call(r, method, shard_refs[self.sharding.coords(r)["dp"]], **kwargs) for r in ranks]
        return Calls(refs, ranks, self.sharding.output_ranks())

    # -- results ---------------------------------------------------------------
    def get_results(self, calls: Calls, timeout_s: float | None = None) -> list[Any]:
        """Results of the output ranks, in their order; raises :class:`WorkerError` on the first failure."""
        import ray

        watched = dict(zip(calls.refs, calls.ranks))
        results: dict[int, Any] = {}
        pending = list(calls.refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=timeout_s)
            if not ready:
                raise self._fail(WorkerError(f"worker group '{self.name_prefix}': no result within {timeout_s}s"))
            ref = ready[0]
            try:
                results[watched[ref]] = ray.get(ref)
            except Exception as exc:  # noqa: BLE001 - re-raised with the worker named
                error = self.describe(watched[ref], exc)
                recoverable = not self.kill_on_error and not isinstance(exc, ray.exceptions.RayActorError)
                if recoverable:
                    ray.wait(pending, num_returns=len(pending))  # let the others finish before a retry
                    raise error from exc
                raise self._fail(self._root_cause(error, exc, pending, watched)) from exc
        return [results[r] for r in (calls.output_ranks if calls.output_ranks is not None else calls.ranks)]

    def _root_cause(
        self, error: WorkerError, exc: BaseException, pending: list[Any], watched: dict[Any, int]
    ) -> WorkerError:
        """When a rank raised (e.g. a collective's 'connection reset'), check whether a peer died first.

        A rank killed mid-collective makes its peers fail within milliseconds; the dead rank is the
        cause worth naming. Waits briefly for the other calls to settle.
        """
        import ray

        if isinstance(exc, ray.exceptions.RayActorError) or not pending:
            return error
        ready, _ = ray.wait(pending, num_returns=len(pending), timeout=3.0)
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as dead:
                root = self.describe(watched[ref], dead)
                return WorkerError(f"{root}; then {error}", root.rank)
            except Exception:  # noqa: BLE001 - another secondary failure
                continue
        return error

    def describe(self, rank: int, exc: BaseException) -> WorkerError:
        """``exc`` (from a call on ``rank``) as a :class:`WorkerError` naming the worker and the cause."""
        import ray

        name = self.worker_names[rank]
        if isinstance(exc, ray.exceptions.RayActorError) and getattr(exc, "actor_init_failed", False):
            lines = [ln.strip() for ln in str(getattr(exc, "error_msg", exc)).splitlines()]
            cause = next((ln for ln in reversed(lines) if re.match(r"^[\w.]+(Error|Exception|Exit)\b", ln)), lines[0])
            where = next((ln for ln in reversed(lines) if ln.startswith("File ")), "")
            return WorkerError(
                f"worker {name} (rank {rank}) failed to start: {cause}" + (f" [{where}]" if where else ""), rank
            )
        if isinstance(exc, ray.exceptions.RayTaskError):
            return WorkerError(f"worker {name} (rank {rank}) raised {_task_error(exc)}", rank)
        if isinstance(exc, ray.exceptions.OutOfMemoryError):
            return WorkerError(f"worker {name} (rank {rank}) was killed for running out of memory: {exc}", rank)
        if isinstance(exc, ray.exceptions.RayActorError):
            reason = str(exc).strip().splitlines()
            summary = next((ln for ln in reason if "died" in ln or "exit" in ln.lower()), reason[0] if reason else "")
            return WorkerError(
                f"worker {name} (rank {rank}) died on node {self.worker_nodes[rank]}: {summary.strip()}", rank
            )
        return WorkerError(f"worker {name} (rank {rank}) failed: {type(exc).__name__}: {exc}", rank)

    def _fail(self, error: WorkerError) -> WorkerError:
        """Record the failure and kill the group at once: peers of a dead rank may hang in a collective."""
        self._failure = error
        self.shutdown(grace_s=0)
        return error

    def worker_pids(self) -> list[int]:
        import ray

        return ray.get([w.pid.remote() for w in self.workers])

    def peak_memory(self) -> list[dict[str, int]]:
        """Each rank's :meth:`WorkerHost.peak_memory`, in rank order."""
        import ray

        return ray.get([w.peak_memory.remote() for w in self.workers])

    def shutdown(self, grace_s: float | None = None) -> None:
        """Ask every worker to shut down, wait up to ``grace_s`` seconds (default
        :data:`SHUTDOWN_GRACE_S`), then kill them all.

        A worker busy in a call (e.g. hung in a collective) does not answer in time and is simply
        killed; nothing it holds outlives its process (design.md §2.9), so killing is always safe —
        asking first lets the healthy ones close process groups and engines cleanly.
        """
        import ray

        workers, self.workers = self.workers, []
        if not workers or not ray.is_initialized():
            return
        grace_s = SHUTDOWN_GRACE_S if grace_s is None else grace_s
        if grace_s > 0:
            ray.wait([w.shutdown.remote() for w in workers], num_returns=len(workers), timeout=grace_s)
        for actor in workers:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead
                pass


class WorkerGroupOwner:
    """Driver-side plumbing for a facade that owns one :class:`RayWorkerGroup` (``self.worker_group``)."""

    worker_group: RayWorkerGroup

    def _all(self, method: Method, *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``method`` on every worker with the same arguments; results in rank order."""
        wg = self.worker_group
        return wg.get_results(wg.run_all_workers_single_data(method, *args, **kwargs))

    def shutdown(self) -> bool:
        """Shut the workers down, killing those that do not answer (the cluster removes the placement group)."""
        group = getattr(self, "worker_group", None)
        if group is not None:
            group.shutdown()
        return True

    def __del__(self) -> None:
        # At interpreter exit Ray may already be gone; never raise from a finalizer.
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001
            pass
