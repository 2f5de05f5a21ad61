"""Faults inside training workers (real Ray actors, real gloo groups): named errors, no hang, clean shutdown."""

from __future__ import annotations

import resource
import time
from pathlib import Path

import pytest
import torch

from rlcore.algorithms.loss_functions import NLLLoss
from rlcore.backends.reference.worker import ReferenceWorker
from rlcore.distributed import RayVirtualCluster, WorkerError
from rlcore.distributed.worker_group import RayWorkerGroup
from rlcore.plugins import BackendSpec, hookimpl
from rlcore.policy import Policy
from tests.distributed.test_runtime import batch, policy_config


class RaisesOnRankOne(NLLLoss):
    """Rank 1 raises before its backward; rank 0 goes on into the gradient all-reduce and waits there."""

    def __call__(self, *args, **kwargs):
        if torch.distributed.get_rank() == 1:
            raise ValueError("rank 1 gave up inside the step")
        return super().__call__(*args, **kwargs)


def test_a_rank_raising_while_its_peer_waits_in_a_collective_does_not_hang(ray_session, tiny_model_dir, tiny_tokenizer):
    cluster = RayVirtualCluster([2])
    policy = Policy(cluster, policy_config(tiny_model_dir), tiny_tokenizer)
    try:
        started = time.monotonic()
        with pytest.raises(WorkerError, match=r"rank1 \(rank 1\) raised ValueError: rank 1 gave up"):
            policy.train(batch(tiny_tokenizer), RaisesOnRankOne())
        print(f"raise inside a collective: named error after {time.monotonic() - started:.2f}s")
        assert time.monotonic() - started < 30
    finally:
        policy.shutdown()
        cluster.shutdown()


def test_a_worker_out_of_memory_is_named(ray_session, tiny_model_dir, tiny_tokenizer):
    cluster = RayVirtualCluster([2])
    policy = Policy(
        cluster, policy_config(tiny_model_dir, logprob_batch_size=64, max_total_sequence_length=2048), tiny_tokenizer
    )
    try:
        victim = policy.worker_group.worker_pids()[1]
        in_use = int(Path(f"/proc/{victim}/status").read_text().split("VmSize:")[1].split()[0]) * 1024
        limit = in_use + (64 << 20)  # 64 MB more address space than it has now
        resource.prlimit(victim, resource.RLIMIT_AS, (limit, limit))
        big = batch(tiny_tokenizer, n=256, seed=2)  # logits alone: 128 rows x 14 x vocab x 4 B per rank... and more
        big["input_ids"] = big["input_ids"].repeat(1, 64)
        big["input_lengths"] = big["input_lengths"] * 0 + big["input_ids"].shape[1]
        with pytest.raises(WorkerError, match=r"rank1 \(rank 1\) (raised .*(memory|MemoryError)|died|was killed)"):
            policy.get_logprobs(big)
    finally:
        policy.shutdown()
        cluster.shutdown()


# -- graceful shutdown ---------------------------------------------------------------------------------


class RecordsShutdown(ReferenceWorker):
    """Writes a file when asked to shut down, so the test can see it was asked (not just killed)."""

    marker_dir: str | None = None

    def mark_shutdown_in(self, directory: str) -> None:
        self.marker_dir = directory

    def shutdown(self) -> None:
        super().shutdown()
        Path(self.marker_dir, f"rank{self.rank}").write_text("closed")

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


class _RecordsShutdownPlugin:
    @hookimpl
    def rlcore_register_backends(self, register):
        register(BackendSpec(name="records-shutdown", kind="training", worker_class=f"{__name__}:RecordsShutdown"))


def test_shutdown_asks_each_worker_then_kills_the_ones_that_do_not_answer(
    ray_session, tiny_model_dir, tiny_tokenizer, rlcore_registry, tmp_path, monkeypatch
):
    import ray

    rlcore_registry.register_plugin(_RecordsShutdownPlugin(), name="records-shutdown")
    monkeypatch.setattr("rlcore.distributed.worker_group.SHUTDOWN_GRACE_S", 3.0)
    cluster = RayVirtualCluster([2])
    cfg = policy_config(tiny_model_dir).model_copy(update={"backend": "records-shutdown"})
    try:
        policy = Policy(cluster, cfg, tiny_tokenizer)
        group: RayWorkerGroup = policy.worker_group
        ray.get([worker.call.remote("mark_shutdown_in", str(tmp_path)) for worker in group.workers])
        busy = group.workers[1].call.remote("sleep", 60)  # rank 1 cannot answer within the grace period
        time.sleep(0.5)
        started = time.monotonic()
        policy.shutdown()
        elapsed = time.monotonic() - started
    finally:
        cluster.shutdown()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0"]  # rank 0 closed itself; rank 1 was killed
    assert 2.5 < elapsed < 10, elapsed
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(busy, timeout=10)
