"""In-process serving engines for the lifecycle kit's own tests (no Ray): one that keeps the contract and
faulty ones the kit must catch.

:class:`FakeServingEngine` serves continuously like an 'async_engine' backend: a loop thread takes one step
(one token for every running request) at a time, under a lock, so a pause lands between two steps. Its model is
a toy recurrence whose greedy token depends on the weights ``{"lm": [[a, b]]}``; each token is tagged with the
weight version it was generated under. A new engine with ``stale=True`` refuses to generate until a refit.

The faults: :class:`HangsDuringDrain` never starts a request submitted while a ``wait`` pause drains (vLLM
#45326); :class:`AbortReturnsPartial` hands an aborted request's partial output to its caller (vLLM's own
abort does, with finish reason 'abort').
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from rlcore.data import BatchedDataDict

VOCAB = 61


class FakeStaleError(RuntimeError):
    """The fake's own refusal to generate on weights no refit gave it."""


class _Request:
    def __init__(self, prompt: list[int]) -> None:
        self.prompt = prompt
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.done = threading.Event()
        self.window = (time.time(), 0.0)

    def restart(self) -> None:
        self.tokens.clear()
        self.logprobs.clear()
        self.versions.clear()


def default_weights() -> dict[str, torch.Tensor]:
    import torch

    return {"lm": torch.tensor([[3.0, 5.0]])}


class FakeServingEngine:
    """A continuously serving engine with the whole lifecycle: pause ('wait', 'keep', 'abort'), resume, refit."""

    continuous_serving = True

    def __init__(
        self,
        max_new_tokens: int = 24,
        step_s: float = 0.002,
        weights: dict[str, torch.Tensor] | None = None,
        stale: bool = False,
    ) -> None:
        self.max_new_tokens, self.step_s = max_new_tokens, step_s
        self.weights = {k: v.clone() for k, v in (weights or default_weights()).items()}
        self.version = 0
        self.stale = stale
        self.running: list[_Request] = []
        self.queued: list[_Request] = []  # submitted while paused or draining: they start on resume
        self.paused = self.draining = self.asleep = self._stopped = False
        self._cond = threading.Condition()
        self._loop_thread = threading.Thread(target=self._loop, daemon=True, name="fake-serving-engine")
        self._loop_thread.start()

    # -- the engine loop -----------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stopped or (self.running and not self.paused))
                if self._stopped:
                    return
                for request in self.running:
                    self._step(request)
                for request in [r for r in self.running if len(r.tokens) >= self.max_new_tokens]:
                    self.running.remove(request)
                    request.window = (request.window[0], time.time())
                    request.done.set()
                self._cond.notify_all()
            time.sleep(self.step_s)

    def _step(self, request: _Request) -> None:
        a, b = (int(x) for x in self.weights["lm"][0].tolist())
        seq = request.prompt + request.tokens
        token = (a * seq[-1] + b * len(seq) + 3) % VOCAB + 2
        request.tokens.append(token)
        request.logprobs.append(-0.05 - 0.01 * (token % 7))
        request.versions.append(self.version)

    # -- GenerationInterface ---------------------------------------------------------------------------------
    def generate_async(self, data: BatchedDataDict, greedy: bool = False) -> list[_Request]:
        requests = [
            _Request(data["input_ids"][i, : int(n)].tolist()) for i, n in enumerate(data["input_lengths"].tolist())
        ]
        with self._cond:
            if self.stale:
                raise FakeStaleError("fake engine: no refit since it started; refit it first")
            if self.asleep:
                raise RuntimeError("fake engine: asleep; call prepare_for_generation first")
            if self.draining:
                self._admit_during_drain(requests)
            elif self.paused:
                self.queued.extend(requests)
            else:
                self.running.extend(requests)
            self._cond.notify_all()
        return requests

    def _admit_during_drain(self, requests: list[_Request]) -> None:
        self.queued.extend(requests)

    def collect(self, handle: list[_Request]) -> BatchedDataDict:
        for request in handle:
            request.done.wait()
        return self._output(handle)

    def as_completed(
        self, handles: Sequence[list[_Request]], timeout_s: float | None = None
    ) -> Iterator[tuple[int, BatchedDataDict]]:
        pending = dict(enumerate(handles))
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while pending:
            ready = [i for i, h in pending.items() if all(r.done.is_set() for r in h)]
            for index in ready:
                yield index, self._output(pending.pop(index))
            if pending and not ready:
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"fake engine: {len(pending)} request(s) not done within {timeout_s} s")
                time.sleep(0.002)

    def generate(self, data: BatchedDataDict, greedy: bool = False) -> BatchedDataDict:
        return self.collect(self.generate_async(data, greedy))

    def _output(self, handle: list[_Request]) -> BatchedDataDict:
        import torch

        from rlcore.data import BatchedDataDict

        width = max(len(r.prompt) for r in handle) + self.max_new_tokens
        ids = torch.zeros(len(handle), width, dtype=torch.long)
        logprobs = torch.zeros(len(handle), width)
        versions = torch.full((len(handle), width), -1, dtype=torch.long)
        for i, r in enumerate(handle):
            p, n = len(r.prompt), len(r.tokens)
            ids[i, : p + n] = torch.tensor(r.prompt + r.tokens)
            logprobs[i, p : p + n] = torch.tensor(r.logprobs)
            versions[i, p : p + n] = torch.tensor(r.versions, dtype=torch.long)
        lengths = torch.tensor([len(r.tokens) for r in handle])
        return BatchedDataDict(
            output_ids=ids,
            logprobs=logprobs,
            generation_lengths=lengths,
            unpadded_sequence_lengths=lengths + torch.tensor([len(r.prompt) for r in handle]),
            weight_version=torch.tensor([min(r.versions, default=self.version) for r in handle]),
            generation_weight_versions=versions,
            generation_window=torch.tensor([r.window for r in handle], dtype=torch.float64),
        )

    def pause_generation(self, mode: str = "wait", timeout_s: float | None = None) -> None:
        with self._cond:
            if mode == "wait":
                self.draining = True
                drained = self._cond.wait_for(lambda: not self.running, timeout_s)
                self.draining = False
                if not drained:
                    raise TimeoutError(f"fake engine 0 not paused within {timeout_s} s")
            elif mode == "abort":
                self._abort()
            self.paused = True

    def _abort(self) -> None:
        for request in self.running:
            request.restart()
        self.queued[:0] = self.running
        self.running = []

    def resume_generation(self, recompute_kv_cache: bool = False) -> None:
        with self._cond:
            self.paused = False
            self.running.extend(self.queued)
            self.queued = []
            self._cond.notify_all()

    def set_weight_version(self, version: int) -> None:
        with self._cond:
            self.version = version

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """The fake's refit: hold copies of ``state_dict``; a stale engine serves again."""
        with self._cond:
            self.weights = {k: v.detach().clone() for k, v in state_dict.items()}
            self.stale = False

    def weight_fingerprints(self) -> list[dict[str, Any]]:
        from rlcore.refit.fingerprint import fingerprint

        with self._cond:
            return [{"weight_version": self.version, "fingerprints": fingerprint(self.weights.items())}]

    def prepare_for_generation(self, *args: Any, **kwargs: Any) -> bool:
        self.asleep = False
        return True

    def finish_generation(self, *args: Any, **kwargs: Any) -> bool:
        self.asleep = True
        return True

    def shutdown(self) -> bool:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._loop_thread.join(5)
        return True


class HangsDuringDrain(FakeServingEngine):
    """vLLM #45326: a request submitted while a ``wait`` pause drains is never started (not even on resume)."""

    def _admit_during_drain(self, requests: list[_Request]) -> None:
        self.lost = requests


class AbortReturnsPartial(FakeServingEngine):
    """An ``abort`` pause that ends the running requests with what they had: their callers get partial output."""

    def _abort(self) -> None:
        for request in self.running:
            request.window = (request.window[0], time.time())
            request.done.set()
        self.running = []


def fake_refit(engine: FakeServingEngine, state_dict: dict[str, torch.Tensor], version: int) -> None:
    """The kit's ``refit`` hook for the fakes."""
    engine.load_weights(state_dict)


def shard(tensor: torch.Tensor, rank: int, ranks: int) -> torch.Tensor:
    """The slice tensor-parallel rank ``rank`` of ``ranks`` holds: its part of the last dimension."""
    width = tensor.shape[-1] // ranks
    return tensor.narrow(-1, rank * width, width)


class ShardedServingEngine(FakeServingEngine):
    """A tensor-parallel engine of ``ranks`` ranks: each holds (and fingerprints) only its slice of every tensor,
    as a vLLM rank whose refits send it only what its loaders read. ``corrupt_rank``: that rank's slices get
    their last element changed after each load (a broken loader; the greedy outputs, computed from the whole
    weights, do not show it)."""

    def __init__(self, ranks: int = 2, corrupt_rank: int | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.ranks, self.corrupt_rank = ranks, corrupt_rank
        self.shards = [self._slices(self.weights, r) for r in range(ranks)]

    def _slices(self, weights: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
        held = {k: shard(v, rank, self.ranks).clone() for k, v in weights.items()}
        if rank == self.corrupt_rank:
            for tensor in held.values():
                tensor.view(-1)[-1] += 1
        return held

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        super().load_weights(state_dict)
        with self._cond:
            self.shards = [self._slices(state_dict, r) for r in range(self.ranks)]

    def weight_fingerprints(self) -> list[dict[str, Any]]:
        from rlcore.refit.fingerprint import fingerprint

        with self._cond:
            return [{"weight_version": self.version, "fingerprints": fingerprint(h.items())} for h in self.shards]


def sharded_fake_refit(
    engine: ShardedServingEngine, state_dict: dict[str, torch.Tensor], version: int
) -> list[dict[str, int]]:
    """The kit's ``refit`` hook for :class:`ShardedServingEngine`: per rank, the fingerprints of the slices sent."""
    from rlcore.refit.fingerprint import fingerprint

    engine.load_weights(state_dict)
    return [fingerprint((k, shard(v, r, engine.ranks)) for k, v in state_dict.items()) for r in range(engine.ranks)]
