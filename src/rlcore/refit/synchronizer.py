"""``WeightSynchronizer``: one ``sync_weights()`` call moves training weights into generation.

It picks the transport from the placement: engines colocated with training
ranks get shared-memory streaming (CUDA IPC on GPU); engines on their own
devices get a collective broadcast. Metadata is exchanged once; the group for
the collective is built once. With ``adapter_refit`` (``policy.lora.refit:
adapter``) no weight moves at all: the policy writes its LoRA adapters as a
PEFT directory and the engines load it as a LoRA module.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypedDict, cast

from rlcore.refit.buckets import RefitError, RefitMetadata
from rlcore.refit.export import DEFAULT_BUCKET_BYTES

if TYPE_CHECKING:
    from ray import ObjectRef

    from rlcore.refit.fingerprint import SentBytes

    #: What a worker group's remote calls return: one future per worker.
    Futures = Sequence[ObjectRef[object]]


class _Part(TypedDict, total=False):
    changed_only: bool  # a LoRA refit after the first: only the adapted layers


class RefitSource(Protocol):
    """The training side of a refit, as the synchronizer calls it (``rlcore.policy.Policy``)."""

    def prepare_refit_info(self, changed_only: bool = False) -> RefitMetadata | None: ...
    def init_collective(self, ip: str, port: int, world_size: int, *, train_world_size: int) -> Futures: ...
    def stream_weights_via_ipc_zmq(
        self, *, endpoints: dict[int, tuple[str, bytes]], bucket_bytes: int, changed_only: bool = False
    ) -> Futures: ...
    def broadcast_weights_for_collective(self, *, bucket_bytes: int, changed_only: bool = False) -> Futures: ...
    def save_lora_adapter(self, path: str) -> None: ...


class RefitTarget(Protocol):
    """The generation side of a refit, as the synchronizer calls it (a ``GenerationInterface`` that can be refit;
    ``set_weight_version`` is optional)."""

    def prepare_refit_info(self, state_dict_info: RefitMetadata, partial: bool = False) -> None: ...
    def refit_endpoints(self) -> dict[int, tuple[str, bytes]]: ...
    def update_weights_via_ipc_zmq(self, bucket_bytes: int) -> Futures: ...
    def refit_world_size(self) -> int: ...
    def init_collective(self, ip: str, port: int, world_size: int, *, train_world_size: int) -> Futures: ...
    def update_weights_from_collective(self, bucket_bytes: int) -> Futures: ...
    def weight_fingerprints(self) -> Sequence[Mapping[str, object]]: ...
    def load_lora_adapter(self, path: str, version: int) -> None: ...


class MasterAddress(Protocol):
    """Where the collective group meets (the run's cluster: ``rlcore.distributed.RayVirtualCluster``)."""

    def get_master_address_and_port(self) -> tuple[str, int]: ...


def _wait(parts: list[tuple[object, Futures]], what: str) -> list[list[object]]:
    """Results of each ``(owner, refs)`` part; on the first failure a :class:`RefitError` naming the worker.

    Both sides of a refit fail together (a dead engine breaks its sender's socket, a dead sender
    its engine's stream), so after the first failure the others get a moment to settle and a
    dead process is named as the cause over its peers' secondary errors.
    """
    import ray

    owner_of = {ref: (owner, rank) for owner, refs in parts for rank, ref in enumerate(refs)}
    pending = list(owner_of)
    failures: list[tuple[ObjectRef[object], BaseException]] = []
    while pending and not failures:
        ready, pending = ray.wait(pending, num_returns=1)
        failures += _failure(ready[0])
    if failures:
        if not isinstance(failures[0][1], ray.exceptions.RayActorError):  # a dead peer may be the cause
            settled, _ = ray.wait(pending, num_returns=len(pending), timeout=3.0)
            for ref in settled:
                failures += _failure(ref)
        ref, exc = next((f for f in failures if isinstance(f[1], ray.exceptions.RayActorError)), failures[0])
        owner, rank = owner_of[ref]
        group = getattr(owner, "worker_group", None)
        cause = str(group.describe(rank, exc)) if group is not None else f"{type(exc).__name__}: {exc}"
        raise RefitError(f"{what} failed: {cause.strip().splitlines()[0]}") from exc
    return [ray.get(refs) for _, refs in parts]


def _failure(ref: ObjectRef[object]) -> list[tuple[ObjectRef[object], BaseException]]:
    import ray

    try:
        ray.get(ref)
    except Exception as exc:  # noqa: BLE001 - collected, then reported with the worker named
        return [(ref, exc)]
    return []


def _plan(metadata: RefitMetadata | None) -> RefitMetadata:
    """The training side's refit plan; a backend that has none cannot be refit (said in one line, not as an
    engine's error on None)."""
    if metadata is None:
        raise RefitError("refit: the training backend's prepare_refit_info() gave no plan (None)")
    return metadata


#: Test hook: the bucket size of a synchronizer not given one (a tiny model then streams in several buckets).
BUCKET_BYTES_ENV = "RLCORE_TEST_REFIT_BUCKET_BYTES"


def _default_bucket_bytes() -> int:
    value = os.environ.get(BUCKET_BYTES_ENV)
    return int(value) if value else DEFAULT_BUCKET_BYTES


class WeightSynchronizer:
    """Keeps a generation backend's weights equal to a policy's.

    ``transport``: ``"auto"`` (shared memory when colocated, else collective),
    ``"shared_memory"`` or ``"collective"``. ``cluster`` provides the
    rendezvous address of the collective group. ``partial_refit``: the
    generation backend declares it can load part of the model (the
    'partial_refit' capability), so a LoRA policy sends only its adapted
    layers after the first refit. ``adapter_refit``: the engines run the
    policy's LoRA adapters as LoRA modules (the 'lora_adapter' capability);
    each refit hands them the adapters alone, in a directory under
    ``scratch_dir`` (default: the system's temporary directory; ``build_run``
    gives the private Ray session's, which is swept even after a crash),
    removed by :meth:`shutdown`.

    Weight versions (vLLM's word, ``weight_version``): each refit publishes one to the engines
    (``set_weight_version``) once its weights are in; the first publishes ``weight_version`` (the version of
    the policy's weights now: a run's start step, or what a replaced synchronizer had), every later one the
    next number. ``verify`` (the generation backend declares ``verified_refit``): after each refit every
    engine reports the version it holds and the fingerprints of what it received
    (``weight_fingerprints()``), compared with what each training rank sent; a mismatch is a
    :class:`RefitError` of one line naming the engine and the tensor (:mod:`rlcore.refit.fingerprint`).
    """

    def __init__(
        self,
        policy: RefitSource,
        generation: RefitTarget,
        *,
        colocated: bool,
        cluster: MasterAddress | None = None,
        transport: str = "auto",
        bucket_bytes: int | None = None,
        partial_refit: bool = False,
        adapter_refit: bool = False,
        scratch_dir: str | None = None,
        verify: bool = False,
        weight_version: int = 0,
    ) -> None:
        if transport == "auto":
            transport = "shared_memory" if colocated else "collective"
        if transport not in ("shared_memory", "collective"):
            raise ValueError(f"unknown refit transport {transport!r}")
        if transport == "collective" and cluster is None:
            raise ValueError("the collective transport needs the cluster for its rendezvous address")
        self.policy, self.generation, self.cluster = policy, generation, cluster
        self.transport = transport
        self.bucket_bytes = bucket_bytes if bucket_bytes is not None else _default_bucket_bytes()
        self.partial_refit = partial_refit
        self.adapter_refit = adapter_refit
        self.scratch_dir = scratch_dir
        self._adapter_root: Path | None = None
        self._adapter_version = 0
        self.metadata: RefitMetadata | None = None
        self._group_ready = False
        self._synced_once = False
        self._partial_plan = False
        self.stale = True
        self.verify = verify
        self._first_version = weight_version
        self.weight_version: int | None = None  # the version the engines hold (None before the first refit)
        self._sent: list[dict[str, int]] | None = None  # per engine: the fingerprints its refits were sent
        self._said_unverified = False

    def _changed_only(self) -> bool:
        """After one whole refit, a LoRA policy sends only its adapted layers, if the engine takes a part."""
        return self._synced_once and self.partial_refit and bool(getattr(self.policy, "refits_changed_only", False))

    def _exchange_metadata(self, changed_only: bool) -> None:
        """Send the engines the plan of this refit: the whole model first, the changed part after (LoRA)."""
        if self.metadata is None:
            self.metadata = _plan(self.policy.prepare_refit_info())
            self.generation.prepare_refit_info(self.metadata)
        if changed_only and not self._partial_plan:
            self.generation.prepare_refit_info(_plan(self.policy.prepare_refit_info(changed_only=True)), partial=True)
            self._partial_plan = True

    def _init_group(self) -> None:
        if self._group_ready:
            return
        assert self.cluster is not None  # __init__ refuses the collective transport without one
        ip, port = self.cluster.get_master_address_and_port()
        world_size = 1 + self.generation.refit_world_size()
        _wait(
            [
                (self.policy, self.policy.init_collective(ip, port, world_size, train_world_size=1)),
                (self.generation, self.generation.init_collective(ip, port, world_size, train_world_size=1)),
            ],
            "joining the refit group",
        )
        self._group_ready = True

    @property
    def policy_weight_version(self) -> int:
        """The version of the policy's weights now: the one the engines hold, or the next refit's when they
        are stale (what a synchronizer that replaces this one starts from)."""
        if self.weight_version is None:
            return self._first_version
        return self.weight_version + int(self.stale)

    def sync_weights(self) -> dict[str, float]:
        """Refit now; returns ``{"bytes", "seconds", "weight_version", "verified_tensors", "verify_seconds"}``. Raises
        :class:`RefitError` on failure, or when verification finds an engine holding other weights."""
        start = time.perf_counter()
        self.stale = True
        version = self._first_version if self.weight_version is None else self.weight_version + 1
        if self.adapter_refit:
            written = self._hand_over_adapters()
            self._publish(version)
            self.stale = False
            return {"bytes": float(written), "seconds": time.perf_counter() - start, "weight_version": float(version)}
        changed_only = self._changed_only()
        self._exchange_metadata(changed_only)
        part: _Part = {"changed_only": True} if changed_only else {}
        if self.transport == "shared_memory":
            endpoints = self.generation.refit_endpoints()  # before the receivers block their engines
            receivers = self.generation.update_weights_via_ipc_zmq(bucket_bytes=self.bucket_bytes)
            senders = self.policy.stream_weights_via_ipc_zmq(
                endpoints=endpoints, bucket_bytes=self.bucket_bytes, **part
            )
            feeders = list(endpoints)  # engine i is fed by training rank feeders[i]
        else:
            self._init_group()
            receivers = self.generation.update_weights_from_collective(bucket_bytes=self.bucket_bytes)
            senders = self.policy.broadcast_weights_for_collective(bucket_bytes=self.bucket_bytes, **part)
            feeders = None  # every engine is fed by training rank 0
        results, _ = _wait([(self.policy, senders), (self.generation, receivers)], "refit")
        sent = cast("list[int]", results)  # bytes per training rank (SentBytes from RefitExportMixin)
        self._publish(version)
        verified, verify_seconds = 0, 0.0
        if self.verify:
            checked = time.perf_counter()
            verified = self._verify(sent, feeders, version)
            verify_seconds = time.perf_counter() - checked
        self.stale = False
        self._synced_once = True
        return {
            "bytes": float(max(sent)),
            "seconds": time.perf_counter() - start,
            "weight_version": float(version),
            "verified_tensors": float(verified),
            "verify_seconds": verify_seconds,
        }

    def _publish(self, version: int) -> None:
        """Tell the engines which weights they hold now (queued behind the refit in each engine)."""
        publish = getattr(self.generation, "set_weight_version", None)
        try:
            if publish is not None:
                publish(version)
        except NotImplementedError:  # a backend without versions (GenerationInterface's default)
            pass
        self.weight_version = version

    def _verify(self, sent: list[int], feeders: list[int] | None, version: int) -> int:
        """Compare what each engine reports holding with what its training rank sent (one line on a mismatch);
        returns the tensors compared per engine (0: not verified)."""
        from rlcore.refit.fingerprint import verify_engines

        reports = self.generation.weight_fingerprints()
        fed = [sent[0]] * len(reports) if feeders is None else [sent[rank] for rank in feeders]
        if not all(hasattr(s, "fingerprints") for s in fed):
            if not self._said_unverified:  # once per run
                print(
                    "notice: refit not verified: the training backend's workers send no fingerprints "
                    "(they do not use rlcore.refit.RefitExportMixin)",
                    file=sys.stderr,
                )
                self._said_unverified = True
            return 0
        if self._sent is None or len(self._sent) != len(fed):
            self._sent = [{} for _ in fed]
        for held, new in zip(self._sent, fed):
            held.update(
                cast("SentBytes", new).fingerprints
            )  # a partial refit (LoRA) sends a part; the rest stays as last sent
        verify_engines(self._sent, reports, version=version)
        return min((len(s) for s in self._sent), default=0)

    def _hand_over_adapters(self) -> int:
        """Adapter refit: the policy writes its adapters, the engines load them; returns the bytes written."""
        from rlcore.training.checkpoint import ADAPTER_WEIGHTS_NAME

        if self._adapter_root is None:
            self._adapter_root = Path(tempfile.mkdtemp(prefix="rlcore-lora-refit-", dir=self.scratch_dir))
        self._adapter_version += 1
        path = self._adapter_root / f"v{self._adapter_version}"
        self.policy.save_lora_adapter(str(path))
        self.generation.load_lora_adapter(str(path), self._adapter_version)
        for old in self._adapter_root.iterdir():
            if old != path:
                shutil.rmtree(old, ignore_errors=True)
        return (path / ADAPTER_WEIGHTS_NAME).stat().st_size

    def shutdown(self) -> None:
        """Remove what the synchronizer wrote (adapter refit's directories)."""
        if self._adapter_root is not None:
            shutil.rmtree(self._adapter_root, ignore_errors=True)
            self._adapter_root = None
