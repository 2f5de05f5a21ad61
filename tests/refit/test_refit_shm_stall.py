"""The shared-memory (colocated) refit stream has a stall deadline, like the collective one: once the stream
runs, an engine that stops answering (hung, not dead) fails its sender within ``stall_timeout_s`` instead of
the 600 s receive timeout, with the training ranks waiting behind rank 0. Real processes: the sender is a
spawned process, the receiver this one, whose load hangs at one bucket."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch

from rlcore.refit import RefitError

BUCKETS = 12
HANG_AT = 6  # the receiver's load of this bucket takes HANG_S
HANG_S = 6.0
STALL_S = 1.0


def tensors() -> dict[str, torch.Tensor]:
    return {f"layer.{i}.weight": torch.full((512,), float(i)) for i in range(BUCKETS)}  # 2 KiB each: a bucket each


def _sender(address: str, authkey: bytes, queue) -> None:
    from rlcore.refit.buckets import metadata_of
    from rlcore.refit.shared_memory import stream_to_receiver

    named = tensors()
    start = time.monotonic()
    try:
        stream_to_receiver(
            iter(named.items()),
            metadata_of(named.items()),
            address,
            authkey,
            bucket_bytes=2048,
            device=torch.device("cpu"),
            timeout_s=60,
            stall_timeout_s=STALL_S,
        )
        queue.put(("ok", time.monotonic() - start))
    except RefitError as exc:
        queue.put(("error", f"{exc}|{time.monotonic() - start}"))


def test_a_receiver_that_hangs_mid_stream_fails_the_sender_at_the_stall_deadline():
    from rlcore.refit.buckets import metadata_of
    from rlcore.refit.shared_memory import ShmReceiver

    loaded: list[str] = []

    def load(named) -> None:
        for name, _ in named:
            loaded.append(name)
            if name == f"layer.{HANG_AT}.weight":
                time.sleep(HANG_S)

    ctx = mp.get_context("spawn")
    receiver, queue = ShmReceiver(), ctx.Queue()
    sender = ctx.Process(target=_sender, args=(receiver.address, receiver.authkey, queue))
    sender.start()
    try:
        with pytest.raises((RefitError, OSError, EOFError)):
            receiver.receive(metadata_of(tensors().items()), load, timeout_s=60, stall_timeout_s=30)
        status, detail = queue.get(timeout=60)
    finally:
        sender.join(timeout=60)
        receiver.close()
    assert status == "error", f"the sender finished although its receiver hung for {HANG_S}s"
    message, took = detail.rsplit("|", 1)
    assert message == f"refit peer sent nothing for {STALL_S:.0f}s"
    # it gave up at the stall deadline, well before the hung load ended (the 60 s timeout would be far later)
    assert float(took) < HANG_S, f"the sender waited {float(took):.1f}s"
    assert len(loaded) == HANG_AT + 1  # nothing was loaded past the hang
