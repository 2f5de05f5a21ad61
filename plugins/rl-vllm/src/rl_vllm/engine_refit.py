"""The receiving side of a weight refit in ``VllmGenerationWorker`` (:class:`EngineRefit`, mixed into it).

``prepare_refit_info`` checks a refit's names and shapes against the engine's checkpoint before any weight
changes; the transports' receive calls (shared memory when colocated, a collective broadcast otherwise) load
each bucket in place (:class:`rl_vllm.refit.InPlaceReload`), and keep what a refit delivered
(``verified_refit``'s fingerprints) and why the engine must not generate (``stale_reason``). An adapter refit
loads the policy's LoRA adapter instead.

Imported only inside the engine actor (with the worker); vLLM and torch are imported inside the functions.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from typing import Any

from rl_vllm.config import VllmConfig
from rl_vllm.engine_env import EngineRank
from rlcore.refit import RefitError
from rlcore.refit.buckets import Regions


class EngineRefit:
    """The refit calls of ``VllmGenerationWorker``; the attributes are the worker's (set in its ``__init__``)."""

    rank: int
    gen_cfg: Any
    cfg: VllmConfig
    place: EngineRank
    llm: Any
    image_token_id: int | None
    weight_version: int
    stale_reason: str | None
    refit_metadata: dict[str, Any] | None
    _partial_refit: bool
    _receiver: Any
    _refit_group: Any
    _lora_request: Any
    _fingerprints: dict[str, int]
    _read_regions: Regions | None
    _asleep: bool
    # the worker's own, and EngineLifecycle's (rl_vllm.serving)
    prepare_for_generation: Callable[..., bool]
    _exclusive: Callable[[], contextlib.AbstractContextManager[None]]

    # -- adapter refit ---------------------------------------------------------------------
    def load_lora_adapter(self, path: str, version: int) -> None:
        """Load the PEFT adapter directory ``path`` and run every later request with it.

        Each version is a new LoRA module (name and id), so no cached prefix of
        an older adapter is reused; the previous one is dropped once this one loaded.
        """
        from vllm.lora.request import LoRARequest

        if self.stale_reason is not None:
            raise RefitError(
                f"engine {self.rank}: an adapter refit runs over the weights the engine loaded, but "
                f"{self.stale_reason}; start it with load_format 'auto' (policy.generation.vllm_cfg)"
            )
        if not os.path.isdir(path):
            raise RefitError(
                f"engine {self.rank}: the adapter directory {path} is not visible here: an adapter "
                "refit needs the engines on the node of training rank 0 (or a shared filesystem)"
            )
        with self._exclusive():
            if self._asleep:
                self.prepare_for_generation()
            request = LoRARequest(f"rlcore-adapter-{version}", version, path)
            if not self.llm.llm_engine.add_lora(request):
                raise RefitError(f"engine {self.rank}: vLLM did not load the LoRA adapter at {path}")
            previous, self._lora_request = self._lora_request, request
            if previous is not None:
                self.llm.llm_engine.remove_lora(previous.lora_int_id)

    # -- weight refit (receiving side) ---------------------------------------------------
    def prepare_refit_info(self, state_dict_info: dict[str, Any], partial: bool = False) -> list[str]:
        """Store ``{hf_name: (shape, dtype)}`` unless it cannot fit the engine's model.

        ``partial``: the following refits send only these tensors (whole
        layers: q/k/v and gate/up together, which vLLM fuses); every other
        weight keeps its value.

        Returns the problems (empty when accepted) instead of raising: an
        exception in an engine actor would make the facade's worker group
        unusable, and a refused refit must leave the engines serving.
        """
        from rl_vllm.refit import metadata_problems, normalize_metadata, without_tower

        try:
            metadata = normalize_metadata(state_dict_info)
        except RefitError as exc:
            return [str(exc)]
        if problems := metadata_problems(metadata, self.gen_cfg.model_name, partial):
            return problems
        # a frozen vision tower is not sent: every refit then reloads the language model only
        if without_tower(metadata, self.gen_cfg.model_name):
            if self.cfg.load_format == "dummy":
                return [
                    "the refit sends no vision tower (frozen), but the engine started with random weights "
                    "(policy.generation.vllm_cfg.load_format: dummy): set load_format: auto"
                ]
            partial = True
        if not partial and metadata != self.refit_metadata:
            self._read_regions = None  # another model plan: record again
        self.refit_metadata = metadata
        self._partial_refit = partial
        return []

    def refit_endpoint(self) -> tuple[str, bytes]:
        """Address and key of this engine's shared-memory receiver (created on first use)."""
        if self._receiver is None:
            from rlcore.refit.shared_memory import ShmReceiver

            self._receiver = ShmReceiver()
        return self._receiver.address, self._receiver.authkey

    def update_weights_via_ipc_zmq(self, bucket_bytes: int | None = None, timeout_s: float = 600.0) -> dict[str, Any]:
        """Receive one refit streamed by the colocated training rank (blocks until it ends).

        The sender's metadata is checked against ``prepare_refit_info``'s before
        any weight changes; a stream that breaks after that leaves the engine
        stale. ``bucket_bytes`` is the sender's to choose (it is in its hello).
        """
        self.refit_endpoint()
        expected = self._expected_metadata()
        regions = {name: r for name, r in (self._read_regions or {}).items() if name in expected}
        return self._refit(
            "shared memory",
            lambda load: self._receiver.receive(expected, load, timeout_s=timeout_s, regions=regions),
            regions,
        )

    def init_collective(self, ip: str, port: int, world_size: int, *, train_world_size: int = 1) -> int:
        """Join the refit group as rank ``train_world_size + engine rank``; returns that rank."""
        from rlcore.refit.collective import init_refit_group

        rank = train_world_size + self.rank
        self._refit_group = init_refit_group(ip, port, world_size, rank, self._device())
        return rank

    def update_weights_from_collective(self, bucket_bytes: int | None = None) -> dict[str, Any]:
        """Receive one refit broadcast by training rank 0, replaying its bucket plan from the metadata."""
        from rlcore.refit import DEFAULT_BUCKET_BYTES
        from rlcore.refit.collective import receive_weights

        if self._refit_group is None:
            raise RefitError(f"engine {self.rank}: update_weights_from_collective before init_collective")
        metadata = self._expected_metadata()
        return self._refit(
            "collective",
            lambda load: receive_weights(
                self._refit_group, metadata, bucket_bytes or DEFAULT_BUCKET_BYTES, self._device(), load
            ),
        )

    def refit_status(self) -> str | None:
        """None when the weights are whole; otherwise why the engine must not generate."""
        return self.stale_reason

    def _expected_metadata(self) -> dict[str, Any]:
        if self.refit_metadata is None:
            raise RefitError(f"engine {self.rank}: no refit info; call prepare_refit_info first")
        return self.refit_metadata

    def _device(self) -> Any:
        import torch

        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    def _refit(self, transport: str, receive: Any, regions: Regions | None = None) -> dict[str, Any]:
        """:meth:`_refit_now` with the engine held (see :meth:`_exclusive`)."""
        with self._exclusive():
            return self._refit_now(transport, receive, regions)

    def _refit_now(self, transport: str, receive: Any, regions: Regions | None = None) -> dict[str, Any]:
        """Run ``receive(load)``; the engine is stale from the first loaded tensor until the reload completes.

        ``regions``: the sender wrote only these slices of those tensors, so only they are fingerprinted (what
        this rank reads of them). A whole refit at tensor_parallel_size > 1 records the slices when they are
        not known yet."""
        from rl_vllm.refit import InPlaceReload, tower_copies
        from rlcore.refit.buckets import region_view
        from rlcore.refit.fingerprint import Fingerprints

        if self._asleep:
            self.prepare_for_generation()
        started = time.perf_counter()
        session: list[InPlaceReload] = []
        previous = self.stale_reason

        received = Fingerprints()  # sampled on the device as the buckets arrive; read once, at the end
        record = self._read_regions is None and not self._partial_refit and self.place.tp_size > 1

        def load(named: Any) -> None:
            if not session:  # weights change from here on
                self.stale_reason = f"a {transport} refit is in progress"
                worker = self.llm.collective_rpc(_own_worker)[0]
                session.append(InPlaceReload(worker, self._partial_refit, record_regions=record))
            # before vLLM's loader fuses them (qkv, gate_up): HF names; of a tensor sent in part, that part
            received.add([(name, region_view(t, regions.get(name))) for name, t in named] if regions else named)
            session[0].load(tower_copies(named) if self.image_token_id is not None else named)

        try:
            receive(load)
            if not session:
                raise RefitError("the refit delivered no tensors")
            session[0].finish()
        except Exception as exc:
            if session:
                session[0].abort()
                self.stale_reason = (
                    f"the last {transport} refit failed part-way ({_reason(exc)}); its weights are a mix of old and new"
                )
            else:
                self.stale_reason = previous  # refused before any weight changed
            if isinstance(exc, RefitError):
                raise
            raise RefitError(f"engine {self.rank}: {transport} refit failed: {_reason(exc)}") from exc
        finally:
            self._forget_old_weights()
        self.stale_reason = None
        if record:
            self._read_regions = session[0].regions
        self._fingerprints.update(received.result())  # a partial refit adds to the last
        return {"tensors": session[0].tensors, "seconds": time.perf_counter() - started}

    def _forget_old_weights(self) -> None:
        """Drop what the engine computed with the old weights: cached prefixes (keys/values) and, of a
        vision-language model, the vision tower's cached outputs (vLLM reuses them for an image seen before)."""
        self.llm.reset_prefix_cache()
        if self.image_token_id is not None:
            self.llm.llm_engine.reset_encoder_cache()

    def reload_floor(self, bucket_bytes: int) -> float:
        """Seconds of an in-place reload of the engine's own checkpoint, already in memory, in a refit's bucket
        order: the least a refit into this rank can cost (``benchmarks/refit.py --tp``). Leaves the checkpoint's
        weights, so the engine is stale until the next refit."""
        from rl_vllm.refit import checkpoint_state, timed_reload

        if getattr(self, "_floor_state", None) is None:
            self._floor_state = checkpoint_state(self.gen_cfg.model_name)
        with self._exclusive():
            seconds = timed_reload(self.llm.collective_rpc(_own_worker)[0], self._floor_state, bucket_bytes)
            self._forget_old_weights()
        self.stale_reason = "reload_floor put the checkpoint's weights back, not the policy's"
        return seconds

    def weight_fingerprints(self) -> dict[str, Any]:
        """``verified_refit``: the ``weight_version`` this engine holds and the fingerprints of the tensors it
        received (per tensor, as sent; vLLM fuses some on load, so what it holds has other names and shapes)."""
        return {"weight_version": self.weight_version, "fingerprints": dict(self._fingerprints)}


def _own_worker(worker: Any) -> Any:
    """Run through ``LLM.collective_rpc``: the engine's in-process ``Worker`` object itself."""
    return worker


def _reason(exc: BaseException) -> str:
    """``Type: message``; for a bare ``assert`` deep in vLLM (no message), where it failed and its line."""
    if str(exc):
        return f"{type(exc).__name__}: {exc}"
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return type(exc).__name__
    last = frames[-1]
    return f"{type(exc).__name__} at {os.path.basename(last.filename)}:{last.lineno}: {last.line}"
