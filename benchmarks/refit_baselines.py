"""``refit.py``'s baselines: moving a refit's bytes with nothing else to do.

- **memcpy**: one ``torch`` copy of a uint8 tensor of that size into an already-touched tensor (this
  process, one torch thread, like the ranks);
- **broadcast**: one raw gloo broadcast of a tensor of that size from one process to one other (or
  ``receivers``; one thread each), kept alive between broadcasts so they interleave with the refits;
  timed on the sender between barriers.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any


def time_memcpy(nbytes: int) -> float:
    import torch

    if not hasattr(time_memcpy, "buffers"):
        src = torch.ones(nbytes, dtype=torch.uint8)
        time_memcpy.buffers = (src, torch.zeros_like(src))  # both touched before any timing
    src, dst = time_memcpy.buffers
    t0 = time.perf_counter()
    dst.copy_(src)
    return time.perf_counter() - t0


def _broadcast_rank(rank: int, port: int, nbytes: int, commands: Any, results: Any, world: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    buf = torch.full((nbytes,), rank, dtype=torch.uint8)
    results.put("ready")
    while commands[rank].get() != "stop":
        dist.barrier()
        t0 = time.perf_counter()
        dist.broadcast(buf, src=0)
        dist.barrier()
        if rank == 0:
            results.put(time.perf_counter() - t0)
    dist.destroy_process_group()


class RawBroadcast:
    """A sender and ``receivers`` gloo processes kept alive between broadcasts, so they interleave with the
    refits."""

    def __init__(self, nbytes: int, receivers: int = 1) -> None:
        import torch.multiprocessing as mp

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        world = 1 + receivers
        self.commands = [ctx.SimpleQueue() for _ in range(world)]
        self.results = ctx.SimpleQueue()
        self.context = mp.start_processes(
            _broadcast_rank,
            args=(port, nbytes, self.commands, self.results, world),
            nprocs=world,
            join=False,
            start_method="spawn",
        )
        for _ in range(world):
            self.results.get()

    def run(self) -> float:
        for q in self.commands:
            q.put("go")
        return self.results.get()

    def close(self) -> None:
        for q in self.commands:
            q.put("stop")
        while not self.context.join():
            pass
