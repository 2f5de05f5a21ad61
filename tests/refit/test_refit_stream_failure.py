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

import pytest
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

    def broadcast(self, tensors, opts):
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


def _receiver_hanging_in_its_second_load(port: int, joined) -> None:
    """An engine that takes the first bucket, then hangs loading the second (a stuck engine, not a dead one)."""
    from rlcore.refit.collective import init_refit_group, receive_weights

    group = init_refit_group("127.0.0.1", port, 2, 1, torch.device("cpu"), timeout_s=GROUP_TIMEOUT_S)
    joined.set()
    loads = []

    def load(named):
        loads.append(named)
        if len(loads) == 2:
            time.sleep(GROUP_TIMEOUT_S * 3)

    receive_weights(group, metadata_of(_weights().items()), 64 * 64 * 4, torch.device("cpu"), load)


def test_a_collective_stream_that_stalls_mid_way_fails_at_the_stall_deadline_not_the_group_timeout():
    """After the first buckets, each bucket has a deadline of its own (``stall_timeout_s``, 60 s by default):
    a hung engine fails the sender within it instead of leaving training rank 0, and the ranks gathering with
    it, in the stream for the refit group's whole timeout (300 s in a run, 20 s here)."""
    from rlcore.refit.buckets import RefitError
    from rlcore.refit.collective import broadcast_weights, init_refit_group

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    joined = ctx.Event()
    receiver = ctx.Process(target=_receiver_hanging_in_its_second_load, args=(port, joined), daemon=True)
    receiver.start()
    try:
        group = init_refit_group("127.0.0.1", port, 2, 0, torch.device("cpu"), timeout_s=GROUP_TIMEOUT_S)
        assert joined.wait(60)
        weights = _weights()
        began = time.monotonic()
        with pytest.raises(RefitError) as stalled:  # one weight per bucket: 6 buckets; bucket 4 is never taken
            broadcast_weights(
                group, iter(weights.items()), metadata_of(weights.items()), 64 * 64 * 4, torch.device("cpu"), 2.0
            )
        took = time.monotonic() - began
        del group  # the timed-out op freed gloo's thread: no wait here
    finally:
        receiver.kill()
        receiver.join(timeout=30)
    assert str(stalled.value) == (
        "refit stream stalled at bucket 4 of 6: a peer of the refit group took no part in it within 2s "
        "(hung, or its process stopped)"
    )
    assert 2.0 <= took < GROUP_TIMEOUT_S / 2, took
