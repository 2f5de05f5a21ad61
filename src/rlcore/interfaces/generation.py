"""Abstract contract of a generation backend."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlcore.data import BatchedDataDict
    from rlcore.interfaces.specs import GenerationDatumSpec, GenerationOutputSpec, RefitInfo


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
        version of the weights that produced each sample, as set by :meth:`set_weight_version`; and
        ``generation_window`` (``[B, 2]`` float64): the wall-clock start and end of the engine call that
        produced each sample (the gaps between calls are the time generation waited)."""
        raise NotImplementedError(f"{type(self).__name__} does not generate asynchronously")

    def set_weight_version(self, version: int) -> None:
        """Name the weights of the latest refit (submitted after it, it applies to the requests after it)."""
        raise NotImplementedError(f"{type(self).__name__} does not generate asynchronously")

    def shutdown(self) -> bool:
        return True
