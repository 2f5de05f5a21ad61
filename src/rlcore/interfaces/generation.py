"""Abstract contract of a generation backend."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlcore.data import BatchedDataDict
    from rlcore.interfaces.specs import GenerationDatumSpec, GenerationOutputSpec


class GenerationInterface(abc.ABC):
    """Generates completions from right-padded prompts.

    ``generate`` returns prompt + completion right-padded in ``output_ids`` and
    ``logprobs`` aligned like the policy's (design.md §2.2): prompt positions
    and padding are 0, position ``i`` of a generated token holds
    ``log p(token_i | tokens_<i)`` under the sampling distribution
    (temperature applied), so the two can be compared index by index.
    """

    @abc.abstractmethod
    def generate(
        self, data: "BatchedDataDict[GenerationDatumSpec]", greedy: bool = False
    ) -> "BatchedDataDict[GenerationOutputSpec]": ...

    @abc.abstractmethod
    def prepare_for_generation(self, *args: Any, **kwargs: Any) -> bool:
        """Wake the engine (reload weights / KV cache where the platform can)."""

    @abc.abstractmethod
    def finish_generation(self, *args: Any, **kwargs: Any) -> bool:
        """Let the engine sleep to free memory for training, where supported."""

    # -- refit, receiving side (see rlcore.refit; used by WeightSynchronizer) ----------------
    def prepare_refit_info(self, state_dict_info: dict[str, Any]) -> None:
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

    def init_collective(
        self, ip: str, port: int, world_size: int, *, train_world_size: int
    ) -> list[Any]:
        """Join the refit group as ranks ``train_world_size ..``; returns futures."""
        raise NotImplementedError(f"{type(self).__name__} cannot receive weights by collective")

    def update_weights_from_collective(self, bucket_bytes: int) -> list[Any]:
        """Start receiving weights broadcast by training rank 0; returns futures."""
        raise NotImplementedError(f"{type(self).__name__} cannot receive weights by collective")

    def shutdown(self) -> bool:
        return True
