"""Abstract contract of a generation backend."""

from __future__ import annotations

import abc
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from rlcore.data import BatchedDataDict
    from rlcore.interfaces.specs import GenerationDatumSpec, GenerationOutputSpec, RefitInfo

#: How :meth:`GenerationInterface.pause_generation` treats the requests running when it is called (vLLM's names).
PauseMode = Literal["abort", "wait", "keep"]
PAUSE_MODES: tuple[PauseMode, ...] = ("abort", "wait", "keep")


def serves_continuously(generation: object) -> bool:
    """``generation.continuous_serving``, False for a backend written before it (a driver that does not subclass
    :class:`GenerationInterface` may lack the property)."""
    return bool(getattr(generation, "continuous_serving", False))


class GenerationInterface(abc.ABC):
    """Generates completions from right-padded prompts.

    ``generate`` returns prompt + completion right-padded in ``output_ids`` and
    ``logprobs`` aligned like the policy's (design.md §2.2): prompt positions
    and padding are 0, position ``i`` of a generated token holds
    ``log p(token_i | tokens_<i)`` under the sampling distribution
    (temperature applied), so the two can be compared index by index.

    A batch may carry ``sampling_seeds`` (``[B]`` int64, optional; design.md §2.1): a seed per request, which an
    engine that can should sample that request with (a generator of its own), so that the same request on the
    same weights gives the same completion, whatever was sampled before it. rlcore's rollouts always send it; an
    engine that ignores it keeps working, but a resumed run does not reproduce its rollouts
    (docs/reproducibility.md).
    """

    @abc.abstractmethod
    def generate(
        self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool = False
    ) -> BatchedDataDict[GenerationOutputSpec]: ...

    @abc.abstractmethod
    def prepare_for_generation(self, *args: Any, **kwargs: Any) -> bool:
        """Wake the engine (reload weights / KV cache where the platform can)."""

    @abc.abstractmethod
    def finish_generation(self, *args: Any, **kwargs: Any) -> bool:
        """Let the engine sleep to free memory for training, where supported."""

    # -- refit, receiving side (see rlcore.refit; used by WeightSynchronizer) ----------------
    def prepare_refit_info(self, state_dict_info: RefitInfo) -> None:
        """Receive ``{hf_name: (shape, dtype)}`` once before the first refit."""
        raise NotImplementedError(f"{type(self).__name__} cannot be refit")

    def refit_endpoints(self) -> dict[int, tuple[str, bytes]]:
        """``{training rank: (socket address, authkey)}`` of the colocated engines' refit listeners.

        Answered on the driver (cached), since the engines are busy receiving during a refit.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot receive streamed weights")

    def update_weights_via_ipc_zmq(self, bucket_bytes: int) -> list[Any]:
        """Start receiving weights streamed by colocated training ranks; returns futures."""
        raise NotImplementedError(f"{type(self).__name__} cannot receive streamed weights")

    def refit_world_size(self) -> int:
        """Number of engine ranks that join the collective refit group."""
        raise NotImplementedError(f"{type(self).__name__} cannot receive weights by collective")

    def init_collective(self, ip: str, port: int, world_size: int, *, train_world_size: int) -> list[Any]:
        """Join the refit group as ranks ``train_world_size ..``; returns futures."""
        raise NotImplementedError(f"{type(self).__name__} cannot receive weights by collective")

    def update_weights_from_collective(self, bucket_bytes: int) -> list[Any]:
        """Start receiving weights broadcast by training rank 0; returns futures."""
        raise NotImplementedError(f"{type(self).__name__} cannot receive weights by collective")

    # -- asynchronous generation (the 'async_generation' capability; async GRPO) -------------------
    def generate_async(self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool = False) -> Any:
        """Submit ``data`` and return at once; :meth:`collect` gives the result of the returned handle.

        Requests run in submission order, and so does a refit submitted after
        them: a request submitted before a refit runs entirely on the old
        weights, one submitted after it on the new ones (the engine finishes
        a request before it takes new weights; nothing is mixed within a sample).
        """
        raise NotImplementedError(f"{type(self).__name__} does not generate asynchronously")

    def collect(self, handle: Any) -> BatchedDataDict[GenerationOutputSpec]:
        """Wait for a submitted request; ``generate``'s output plus ``weight_version`` (``[B]`` int64): the
        version of the weights that produced each sample, as set by :meth:`set_weight_version` (the oldest, when
        a refit landed while the sample was generated); and ``generation_window`` (``[B, 2]`` float64): the
        wall-clock start and end of the engine call that produced each sample (the gaps between calls are the
        time generation waited).

        An 'in_flight_weight_updates' backend adds ``generation_weight_versions`` (``[B, T]`` int64, aligned
        with ``output_ids``): the version of the weights that generated each token, -1 at prompt and padding
        positions. A sample's tokens then form spans of versions, each span's logprobs those of its weights."""
        raise NotImplementedError(f"{type(self).__name__} does not generate asynchronously")

    def set_weight_version(self, version: int) -> None:
        """Name the weights of the latest refit (submitted after it, it applies to the requests after it). On an
        'async_engine' backend, call it while paused, before the resume: every token after the resume carries it."""
        raise NotImplementedError(f"{type(self).__name__} does not generate asynchronously")

    def as_completed(
        self, handles: Sequence[Any], timeout_s: float | None = None
    ) -> Iterator[tuple[int, BatchedDataDict[GenerationOutputSpec]]]:
        """``(index into handles, collected output)`` for each of ``handles`` (from :meth:`generate_async`), in
        the order they finish. This default collects them in the order given; an ``async_engine`` backend yields
        each as soon as it is done. ``timeout_s``: raise ``TimeoutError`` when the next one is not done by then."""
        for index, handle in enumerate(handles):
            yield index, self.collect(handle)

    # -- the engine lifecycle (the 'async_engine' and 'in_flight_weight_updates' capabilities) ---------------
    # An 'async_engine' backend serves requests continuously: ``generate_async`` calls from any thread join
    # one running batch between two engine steps, and each call's result is ready when its own requests are.
    @property
    def continuous_serving(self) -> bool:
        """True when this instance serves requests continuously (an 'async_engine' backend configured so): the
        core then submits each sample group on its own and takes the results as they finish. False (the
        default): the core sends whole batches, which an engine that runs one call at a time needs."""
        return False

    def pause_generation(self, mode: PauseMode = "wait", timeout_s: float | None = None) -> None:
        """Stop the engines between two engine steps; returns once every engine is paused.

        What happens to the requests running at the call:

        - ``"wait"``: they finish first (a drain); then the engines stop;
        - ``"keep"``: they stop where they are, keeping their tokens and KV cache, and continue on resume;
        - ``"abort"``: they are stopped and their partial output dropped; on resume they start again from their
          prompt, so their callers still get one whole completion (never an aborted one).

        A request submitted while paused, or during a drain, is queued and starts on resume: never refused
        for the pause, never lost. Weights may be refit while paused (with 'in_flight_weight_updates', also
        after a ``"keep"`` pause with requests in flight). ``TimeoutError``, naming the engine, when an engine
        is not paused within ``timeout_s``.
        """
        raise NotImplementedError(f"{type(self).__name__} has no engine lifecycle ('async_engine')")

    def resume_generation(self, recompute_kv_cache: bool = False) -> None:
        """Continue after :meth:`pause_generation`. ``recompute_kv_cache``: the KV cache of the requests kept
        across the pause is computed again with the current weights before they continue (their tokens so far,
        and those tokens' logprobs, stay as generated); otherwise they continue on the cache the old weights
        computed. Either way, every token generated after the resume comes from the current weights."""
        raise NotImplementedError(f"{type(self).__name__} has no engine lifecycle ('async_engine')")

    def shutdown(self) -> bool:
        return True
