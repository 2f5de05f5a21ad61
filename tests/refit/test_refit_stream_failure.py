"""A refit that fails part-way on the sending rank leaves no training rank inside a collective (issue 52, item 2).

Every training rank iterates the weights (gathering sharded ones is collective); rank 0 sends them. When rank 0's
engine died mid-stream, rank 0 left the iteration with the error and the other ranks waited in the next gather
for the group's whole timeout: the run hung with one rank in ``wait_tensor`` and no signal ending it. The sender
now finishes the iteration (the gathers) before its error goes on. Two real gloo ranks here, each weight
all-reduced as a sharded weight is gathered, and an engine group whose second broadcast fails."""

from __future__ import annotations

import multiprocessing as mp
import socket
import time
from datetime import timedelta

import torch

from rlcore.refit.buckets import metadata_of
from rlcore.refit.export import RefitExportMixin

#: The training group's deadline here: a rank left waiting fails the test after this long, not never.
GROUP_TIMEOUT_S = 20


def _weights() -> dict[str, torch.Tensor]:
    return {f"layers.{i}.weight": torch.full((64, 64), float(i)) for i in range(6)}


class GatheringWorker(RefitExportMixin):
    """A training worker whose full weights are gathered collectively, one at a time."""

    device = torch.device("cpu")

    def prepare_refit_info(self):
        return metadata_of(_weights().items())

    def iter_refit_tensors(self):
        import torch.distributed as dist

        for name, tensor in _weights().items():
            full = tensor.clone()
            dist.all_reduce(full)  # every rank takes part, as in a gather of shards
            yield name, full


class EngineDiesAtTheSecondBucket:
    """The refit group as rank 0 sees it when its engine dies mid-stream."""

    def __init__(self) -> None:
        self.calls = 0

    def broadcast(self, tensor, root):
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("[gloo] Connection closed by peer")
        return type("Done", (), {"wait": lambda self: True})()


def _rank(rank: int, port: int, results, release) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=GROUP_TIMEOUT_S),
    )
    worker = GatheringWorker()
    if rank == 0:
        worker._refit_group = EngineDiesAtTheSecondBucket()
    began = time.monotonic()
    try:
        sent = worker.broadcast_weights_for_collective(bucket_bytes=64 * 64 * 4)  # one weight per bucket
        outcome = f"returned {int(sent)}"
    except RuntimeError as exc:
        outcome = f"raised {str(exc).splitlines()[0]}"
    results.put((rank, outcome, time.monotonic() - began))
    release.wait(120)  # a Ray actor's process lives on after its call failed: so does this one, until both told
    dist.destroy_process_group()


def test_a_sender_failing_mid_stream_leaves_the_other_ranks_out_of_the_gathers():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results, release = ctx.Queue(), ctx.Event()
    ranks = [ctx.Process(target=_rank, args=(rank, port, results, release)) for rank in (0, 1)]
    for process in ranks:
        process.start()
    try:
        outcomes = dict((rank, (outcome, took)) for rank, outcome, took in (results.get(timeout=120) for _ in ranks))
    finally:
        release.set()
        for process in ranks:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()
    assert outcomes[0][0] == "raised [gloo] Connection closed by peer", outcomes
    assert outcomes[1][0] == "returned 0", outcomes  # it finished its gathers: rank 0 took part in all of them
    assert max(took for _, took in outcomes.values()) < GROUP_TIMEOUT_S / 2, outcomes
