"""Lock step for the engine loops of one tensor-parallel ``async_engine`` engine (``tensor_parallel_size`` > 1).

Under vLLM's ``external_launcher`` every rank of an engine runs its own scheduler and must make exactly the same
engine calls in the same order (``add_request`` with the same ids, ``abort_request``, ``step``,
``reset_prefix_cache``), or the ranks' collectives diverge and hang. Requests, pauses and commands reach each
rank's actor at slightly different times, so the loop of tensor-parallel rank 0 *leads*: each iteration it
decides what the engine does (a :class:`Tick`) and publishes it; the other ranks' loops *follow*: they wait for
the next tick and apply exactly it. Lifecycle calls (pause, resume, holding the engine for a refit) run on the
leader; a follower's call of the same kind and number waits for the leader's :class:`Outcome` and mirrors it.

The channel is the engine's own rendezvous store (the ``TCPStore`` that ``external_launcher``'s process group
was set up with, ``MASTER_ADDR:MASTER_PORT``), under a prefix: the leader sets ``tick/<n>`` (JSON, never
pickle); each follower waits for it, reads it, runs it and pushes ``{"tick": n}`` on its queue ``done/<rank>``.
Before it publishes tick ``n + 1`` the leader pops each follower's report of tick ``n`` (one store round trip
each; then it deletes ``tick/<n>``), so it never steps into a collective a follower will not join: a follower
whose loop failed (or was stopped) pushes its error instead, and a follower that reports nothing within
``follower_lag_s`` (its process died, its loop is stuck) is named in a :class:`FollowerFailed` as well. A
follower's wait for the leader's lifecycle outcome is bounded too (``outcome(..., timeout_s)``). Waits are sliced
so a rank notices ``stop`` (which also wakes the waits it is in).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

#: A follower re-checks for ``stop`` this often while no tick comes (each slice that ends logs a c10d warning).
WAIT_SLICE_S = 30.0
#: How long a follower waits for a request the leader admitted but this rank's actor has not received yet.
REQUEST_WAIT_S = 30.0
#: How long the leader waits for a follower to report the previous tick before it gives up on it. Generous: a
#: follower may still wait up to ``REQUEST_WAIT_S`` for a request, or load its share of a refit, while the leader
#: would only block in the step's collective; far below gloo's own timeout (minutes), which it replaces.
FOLLOWER_LAG_S = 120.0
#: How long a follower's lifecycle call waits for the leader's outcome (a pause's ``timeout_s`` is added to it).
OUTCOME_WAIT_S = 300.0
_STOP = b'{"stop": true}'


class FollowerFailed(RuntimeError):
    """A follower of the leading rank failed, was stopped, or reported no tick in time; names its rank."""


@dataclass
class Tick:
    """One iteration of the leading loop: the pause state it ran in, the weight version that tags its step's
    tokens (and salts its admitted prompts), then either one named command or admissions followed by a step
    when requests are running. ``error``: the leader's loop failed (the followers fail with it)."""

    state: str
    version: int
    admit: list[tuple[str, str]] = field(default_factory=list)  # (request key, engine request id)
    command: str | None = None
    error: str | None = None

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Tick:
        data = json.loads(raw)
        data["admit"] = [(str(key), str(rid)) for key, rid in data.get("admit", [])]
        return cls(**data)


@dataclass
class Outcome:
    """How the leader's lifecycle call ended: the number of ticks it had published by then (a follower applies
    them all before it returns), ``was`` (the state before a refit's hold) and its error, if it raised."""

    ticks: int
    was: str | None = None
    error: str | None = None
    timed_out: bool = False


class Lockstep:
    """One rank's end of its engine's tick channel; ``leader`` is tensor-parallel rank 0.

    ``connect()`` opens a connection to the store: each thread gets its own (a ``TCPStore`` client runs one
    request at a time, so the loop's wait for a tick would hold up a lifecycle call's wait, or a stop's wake-up).
    """

    def __init__(
        self, connect: Callable[[], Any], tp_rank: int, tp_size: int, follower_lag_s: float = FOLLOWER_LAG_S
    ) -> None:
        self._connect = connect
        self._local = threading.local()
        self.leader = tp_rank == 0
        self.tp_rank = tp_rank
        self._followers = tp_size - 1
        self.follower_lag_s = follower_lag_s
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()
        self._awaited: set[str] = set()  # keys a thread of this rank waits for (woken by stop)
        self._stopping = False

    @classmethod
    def of_engine(cls, tp_rank: int, tp_size: int) -> Lockstep:
        """Join the store of the engine's ``external_launcher`` group (``MASTER_ADDR:MASTER_PORT``, set by
        :func:`rl_vllm.engine_env.prepare_process_env`), under a prefix of its own."""
        from datetime import timedelta

        import torch.distributed as dist

        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])

        def connect() -> Any:
            client = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=WAIT_SLICE_S))
            return dist.PrefixStore("rl-vllm-lockstep/", client)

        return cls(connect, tp_rank, tp_size)

    @property
    def _store(self) -> Any:
        store = getattr(self._local, "store", None)
        if store is None:
            store = self._local.store = self._connect()
        return store

    # -- ticks ---------------------------------------------------------------------------------------------
    def publish(self, n: int, tick: Tick) -> None:
        """Leader: tick ``n`` (0-based, consecutive)."""
        self._store.set(f"tick/{n}", tick.to_json())

    def followers_done(self, n: int) -> bool:
        """Leader: every follower reported its next step of tick ``n`` (before tick ``n + 1`` is published: tick
        ``n`` done; after a tick that admits requests: those requests taken), then tick ``n``'s key is deleted.
        False once this rank stops; :class:`FollowerFailed` naming the first follower that reported a failure, or
        nothing within ``follower_lag_s``."""
        from datetime import timedelta

        from torch.distributed import DistStoreError

        for rank in range(1, self._followers + 1):
            queue = f"done/{rank}"
            if not self._awaiting(queue):
                return False
            deadline = time.monotonic() + self.follower_lag_s
            try:
                while True:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise FollowerFailed(
                            f"tensor-parallel rank {rank} reported no progress on tick {n} within "
                            f"{self.follower_lag_s}s (its process ended or its engine loop is stuck); the leading "
                            "rank stops instead of entering a collective it would not join"
                        )
                    self._store.set_timeout(timedelta(seconds=min(WAIT_SLICE_S, left)))
                    try:
                        raw = self._store.queue_pop(queue)
                        break
                    except DistStoreError as exc:  # a slice ended: look at stop, wait again
                        if "wait timeout" not in str(exc):
                            raise
                        if self._stopping:
                            return False
            finally:
                self._done_awaiting(queue)
            if raw == _STOP or self._stopping:
                return False
            report = json.loads(raw)
            if report.get("error") is not None:
                raise FollowerFailed(f"tensor-parallel rank {rank} failed at tick {report['tick']}: {report['error']}")
        self._store.delete_key(f"tick/{n}")
        return True

    def next_tick(self, n: int) -> Tick | None:
        """Follower: tick ``n`` once the leader published it; None once this rank stops."""
        raw = self._wait(f"tick/{n}")
        return None if raw is None else Tick.from_json(raw)

    def report(self, n: int, error: str | None = None) -> None:
        """Follower: tick ``n`` ran, or its requests were taken (a tick that admits is reported both times), or,
        with ``error``, this rank's loop failed or stopped at tick ``n``."""
        self._store.queue_push(f"done/{self.tp_rank}", json.dumps({"tick": n, "error": error}).encode())

    # -- lifecycle calls -------------------------------------------------------------------------------------
    def call_number(self, kind: str) -> int:
        """This rank's count of lifecycle calls of ``kind`` so far: the leader's and a follower's ``k``-th calls
        of a kind are the same call (the driver sends each to every rank of the engine)."""
        with self._lock:
            k = self._counts.get(kind, 0)
            self._counts[kind] = k + 1
        return k

    def tell(self, kind: str, k: int, outcome: Outcome) -> None:
        """Leader: how its ``k``-th ``kind`` call ended."""
        self._store.set(f"{kind}/{k}", json.dumps(asdict(outcome)).encode())

    def outcome(
        self, kind: str, k: int, timeout_s: float = OUTCOME_WAIT_S, progress: Callable[[], int] = lambda: 0
    ) -> Outcome | None:
        """Follower: the leader's outcome of its ``k``-th ``kind`` call; None once this rank stops;
        ``TimeoutError`` when the leader tells none within ``timeout_s``, counted again while ``progress()`` (the
        ticks this rank applied) grows: a leader still publishing ticks is alive (e.g. draining)."""
        while True:
            seen = progress()
            try:
                raw = self._wait(f"{kind}/{k}", timeout_s)
                break
            except TimeoutError:
                if progress() == seen:
                    raise TimeoutError(
                        f"the leading rank (tensor-parallel rank 0) told no outcome of its {kind} call #{k} within "
                        f"{timeout_s}s and published no tick meanwhile (did its actor get the same call? is it "
                        "alive?)"
                    ) from None
        if raw is None:
            return None
        self._acknowledge(f"{kind}/{k}", f"ack/{kind}/{k}")
        return Outcome(**json.loads(raw))

    # -- waiting -------------------------------------------------------------------------------------------------
    def stop(self) -> None:
        """Wake every wait of this rank (they return None or False)."""
        with self._lock:
            self._stopping = True
            awaited = list(self._awaited)
        for key in awaited:
            try:
                if key.startswith("done/"):  # the leader pops a follower's queue
                    self._store.queue_push(key, _STOP)
                else:
                    self._store.set(key, _STOP)
            except Exception:  # noqa: BLE001 - the store's server (the leader's process) may be gone
                pass

    def _awaiting(self, key: str) -> bool:
        with self._lock:
            if self._stopping:
                return False
            self._awaited.add(key)
            return True

    def _done_awaiting(self, key: str) -> None:
        with self._lock:
            self._awaited.discard(key)

    def _wait(self, key: str, timeout_s: float | None = None) -> bytes | None:
        from datetime import timedelta

        from torch.distributed import DistNetworkError, DistStoreError

        if not self._awaiting(key):
            return None
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            while True:
                left = WAIT_SLICE_S if deadline is None else min(WAIT_SLICE_S, deadline - time.monotonic())
                if left <= 0:
                    raise TimeoutError(f"{key!r} was not set within {timeout_s}s")
                try:
                    self._store.wait([key], timedelta(seconds=left))
                except DistStoreError as exc:  # a slice ended: look at stop, wait again
                    if "wait timeout" not in str(exc):
                        raise
                    if self._stopping:
                        return None
                    continue
                except DistNetworkError as exc:  # the store lives in the leader's process
                    raise ConnectionError(
                        f"the tick channel to tensor-parallel rank 0 broke while waiting for {key!r} (did its "
                        f"process end?): {str(exc).splitlines()[0]}"
                    ) from exc
                raw: bytes = self._store.get(key)
                return None if raw == _STOP or self._stopping else raw
        finally:
            self._done_awaiting(key)

    def _acknowledge(self, key: str, ack: str) -> None:
        if self._store.add(ack, 1) == self._followers:  # the last follower to read it
            self._store.delete_key(key)
            self._store.delete_key(ack)
