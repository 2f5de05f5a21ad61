"""``RefitExportMixin``: the sending side of refit, for any training worker.

A training worker provides two methods and mixes this in:

- ``prepare_refit_info() -> {hf_name: (shape, dtype name)}``: full, Hugging
  Face-named tensors, in a deterministic order;
- ``iter_refit_tensors()``: yields ``(hf_name, full tensor)`` in that order.
  Every rank iterates it (gathering sharded weights is collective); training
  rank 0's tensors are the ones sent.

and gets ``stream_weights_via_ipc_zmq`` (colocated, shared memory / CUDA IPC)
and ``init_collective`` + ``broadcast_weights_for_collective`` (collective).

A worker that trains LoRA adapters also takes ``changed_only=True`` in both
of its methods: the tensors that can have changed since the first refit (the
adapted layers, merged). The transports pass it through.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from rlcore.refit.buckets import RefitMetadata

if TYPE_CHECKING:
    import torch

    from rlcore.refit.collective import BroadcastGroup

NamedTensors = Iterator[tuple[str, "torch.Tensor"]]

#: Default bucket size; the synchronizer passes the same value to both sides.
DEFAULT_BUCKET_BYTES = 64 << 20


class RefitExportMixin:
    device: torch.device
    _refit_group: BroadcastGroup | None = None

    def prepare_refit_info(self) -> RefitMetadata:
        raise NotImplementedError

    def iter_refit_tensors(self) -> NamedTensors:
        raise NotImplementedError

    def _rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank() if dist.is_initialized() else 0

    def _refit_stream(self, changed_only: bool) -> tuple[NamedTensors, Callable[[], RefitMetadata]]:
        """The tensors to send and their metadata; only a LoRA worker is ever asked for ``changed_only``."""
        if not changed_only:
            return self.iter_refit_tensors(), self.prepare_refit_info
        return (
            self.iter_refit_tensors(changed_only=True),  # type: ignore[call-arg]
            lambda: self.prepare_refit_info(changed_only=True),  # type: ignore[call-arg]
        )

    def _drain(self, tensors: NamedTensors) -> None:
        for _ in tensors:  # take part in the gathers rank 0's iteration needs
            pass

    def _send_or_drain(self, tensors: NamedTensors, send: Callable[[NamedTensors], int]) -> int:
        """``send(tensors)``; if it fails part-way (its engine died mid-stream), the rest of ``tensors`` is still
        iterated before the error goes on: the other training ranks are inside the same gathers, and a rank that
        left them would leave the others waiting in a collective for the group's whole timeout (the run hung
        with rank 0 gone and rank 1 in ``wait_tensor``)."""
        try:
            return send(tensors)
        except BaseException:
            self._drain(tensors)
            raise

    def stream_weights_via_ipc_zmq(
        self,
        endpoints: dict[int, tuple[str, bytes]],
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        changed_only: bool = False,
    ) -> int:
        """Stream every weight to the colocated engine of this rank, if ``endpoints`` names one.

        ``endpoints`` maps a training rank to the ``(socket address, authkey)``
        of the engine sharing its bundle. Returns the bytes this rank sent.
        """
        from rlcore.refit.shared_memory import stream_to_receiver

        tensors, info = self._refit_stream(changed_only)
        endpoint = endpoints.get(self._rank())
        if endpoint is None:
            self._drain(tensors)
            return 0
        address, authkey = endpoint
        return self._send_or_drain(
            tensors, lambda stream: stream_to_receiver(stream, info(), address, authkey, bucket_bytes, self.device)
        )

    def init_collective(self, ip: str, port: int, world_size: int, *, train_world_size: int = 1) -> None:
        """Training rank 0 joins the refit group as its rank 0; other training ranks stay out."""
        from rlcore.refit.collective import init_refit_group

        if self._rank() == 0:
            self._refit_group = init_refit_group(ip, port, world_size, 0, self.device)

    def broadcast_weights_for_collective(
        self,
        kv_scales: dict[str, float] | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        changed_only: bool = False,
    ) -> int:
        from rlcore.refit.collective import broadcast_weights

        tensors, info = self._refit_stream(changed_only)
        if self._rank() != 0:
            self._drain(tensors)
            return 0
        group = self._refit_group
        if group is None:
            self._drain(tensors)
            raise RuntimeError("broadcast_weights_for_collective before init_collective")
        return self._send_or_drain(
            tensors, lambda stream: broadcast_weights(group, stream, info(), bucket_bytes, self.device)
        )
