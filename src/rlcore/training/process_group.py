"""Joining torch.distributed groups without listening on every interface.

torch's ``TCPStore`` server binds all interfaces; rlcore keeps sockets on the
address the cluster chose (loopback for a private local cluster) by opening
the listening socket itself and handing its descriptor to the store.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist


def tcp_store(
    host: str, port: int, world_size: int, is_master: bool, timeout: timedelta = timedelta(minutes=10)
) -> dist.TCPStore:
    """A rendezvous store whose server (on the master) listens on ``host`` only."""
    import torch.distributed as dist

    if not is_master:
        return dist.TCPStore(host, port, world_size, False, timeout=timeout)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    return dist.TCPStore(host, port, world_size, True, timeout=timeout, master_listen_fd=sock.detach())


def init_distributed(timeout: timedelta = timedelta(minutes=10)) -> torch.device:
    """Join the default process group from the environment a worker group sets; returns this rank's device.

    On a GPU the group has NCCL for CUDA tensors and gloo for CPU ones (offloaded state,
    checkpoint gathers); on CPU, gloo. The device is the rank's GPU: Ray narrows
    ``CUDA_VISIBLE_DEVICES`` to it, so it is ``cuda:0`` unless several are visible (then
    ``LOCAL_RANK``). A CPU worker group hides the GPUs from its workers altogether.
    """
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    if cuda:
        index = 0 if torch.cuda.device_count() == 1 else int(os.environ.get("LOCAL_RANK", 0))
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = tcp_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, rank == 0, timeout)
        dist.init_process_group(
            "cpu:gloo,cuda:nccl" if cuda else "gloo", store=store, rank=rank, world_size=world_size, timeout=timeout
        )
    return device
