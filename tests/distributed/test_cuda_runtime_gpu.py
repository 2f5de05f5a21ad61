"""rlcore's own CUDA runtime pieces on a GPU: NCCL groups from its rendezvous, and where workers run.

- A one-rank default group (``init_distributed``, rlcore's loopback-only TCP store) is NCCL on
  ``cuda:0`` (with gloo for CPU tensors), reduces a device tensor, and its store listens on 127.0.0.1 only; a one-rank
  refit group (``init_refit_group``) is a ``ProcessGroupNCCL`` that broadcasts packed buckets.
- Two ranks on two GPUs exchange a refit over NCCL (skipped with fewer GPUs: NCCL refuses two
  ranks on one device).
- Workers of a CPU cluster stay on the CPU on a machine that has a GPU: Ray leaves
  ``CUDA_VISIBLE_DEVICES`` alone for actors that ask for no GPU, so a backend that picks CUDA
  whenever ``torch.cuda.is_available()`` would put a "CPU" run on the GPU (and rank 1 of a
  two-rank CPU run on a device that does not exist).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys
from typing import Any

import pytest
import torch

from tests.support.support_gpu import NO_RAY, missing

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore::UserWarning")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_ONE_RANK = r"""
import json, os, sys
import torch
import torch.distributed as dist
from rlcore.training.process_group import init_distributed
from rlcore.refit import metadata_of
from rlcore.refit.collective import broadcast_weights, init_refit_group

device = init_distributed()
out = {"device": str(device), "backend": dist.get_backend()}
t = torch.full((4,), 3.0, device=device)
dist.all_reduce(t)
out["all_reduce"] = t.tolist()
port = int(os.environ["MASTER_PORT"])
listening = []
for table in ("/proc/net/tcp", "/proc/net/tcp6"):
    if os.path.exists(table):
        for line in open(table).read().splitlines()[1:]:
            fields = line.split()
            address, hex_port = fields[1].rsplit(":", 1)
            if fields[3] == "0A" and int(hex_port, 16) == port:
                listening.append(address)
out["listening"] = listening
group = init_refit_group("127.0.0.1", int(sys.argv[1]), 1, 0, device)
out["refit_group"] = type(group).__name__
tensors = {"w": torch.randn(300, 7, device=device), "b": torch.arange(10, device=device),
           "h": torch.randn(33, device=device).to(torch.bfloat16)}
out["sent"] = broadcast_weights(group, iter(tensors.items()), metadata_of(tensors.items()), 2048, device)
torch.cuda.synchronize()
for close in ("shutdown", "abort"):
    if hasattr(group, close):
        getattr(group, close)()
        break
dist.destroy_process_group()
print(json.dumps(out), flush=True)
"""


def test_one_rank_nccl_groups_from_rlcore_rendezvous() -> None:
    env = {
        **os.environ,
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
    }
    child = subprocess.run(
        [sys.executable, "-c", _ONE_RANK, str(_free_port())], env=env, capture_output=True, text=True, timeout=180
    )
    assert child.returncode == 0, child.stderr[-3000:]
    out = json.loads(child.stdout.strip().splitlines()[-1])
    # NCCL for CUDA tensors, gloo for the CPU ones (offloaded state, checkpoint gathers): one default group
    assert out["device"] == "cuda:0" and out["backend"] == "cpu:gloo,cuda:nccl", out
    assert out["all_reduce"] == [3.0] * 4
    assert out["listening"] == ["0100007F"], f"the rendezvous store listens on {out['listening']}, not 127.0.0.1"
    assert out["refit_group"] == "ProcessGroupNCCL" and out["sent"] > 0, out


def _nccl_refit_rank(rank: int, port: int, queue: Any) -> None:
    from rlcore.refit import metadata_of
    from rlcore.refit.collective import broadcast_weights, init_refit_group, receive_weights

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    g = torch.Generator().manual_seed(0)
    tensors = {"w": torch.randn(300, 70, generator=g), "b": torch.randn(9, generator=g).to(torch.bfloat16)}
    meta = metadata_of(tensors.items())
    group = init_refit_group("127.0.0.1", port, 2, rank, device, timeout_s=120)
    if rank == 0:
        queue.put(
            (
                "sent",
                broadcast_weights(
                    group, iter({k: v.to(device) for k, v in tensors.items()}.items()), meta, 4096, device
                ),
            )
        )
        return
    got: dict[str, torch.Tensor] = {}
    receive_weights(group, meta, 4096, device, lambda named: got.update({n: t.cpu().clone() for n, t in named}))
    queue.put(("equal", all(torch.equal(got[k], v) for k, v in tensors.items()) and set(got) == set(tensors)))


def test_nccl_refit_between_two_gpus() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (NCCL refuses two ranks on one device)")
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_nccl_refit_rank, args=(rank, port, queue)) for rank in range(2)]
    for p in procs:
        p.start()
    try:
        results = dict(queue.get(timeout=180) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=60)
    assert results["sent"] > 0 and results["equal"] is True


@pytest.mark.skipif(missing("ray"), reason=NO_RAY)
def test_cpu_cluster_on_a_gpu_machine_stays_on_cpu(ray_session: None, tiny_model_dir: str, tiny_tokenizer: Any) -> None:
    from rlcore.config import load_config_dict
    from rlcore.distributed import RayVirtualCluster
    from rlcore.policy import Policy

    cfg = load_config_dict(
        {"policy": {"backend": "reference", "model_name": tiny_model_dir, "train_global_batch_size": 2}}
    ).policy
    cluster = RayVirtualCluster([2])
    try:
        policy = Policy(cluster, cfg, tiny_tokenizer, name_prefix="cpu-on-gpu-host", init_reference_model=False)
        try:
            devices = policy._all("report_device_id")
        finally:
            policy.shutdown()
    except Exception as exc:  # rank 1 on 'cuda:1' of a one-GPU machine fails to start
        pytest.fail(f"a 2-rank CPU cluster did not start on a GPU machine: {str(exc)[:500]}")
    finally:
        cluster.shutdown()
    assert devices == ["cpu", "cpu"], (
        f"workers of a CPU cluster (use_gpus=False) run on {devices}: Ray does not hide the GPU from actors "
        "that ask for none, and init_distributed picks CUDA whenever torch sees one"
    )
