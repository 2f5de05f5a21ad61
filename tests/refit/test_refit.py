"""Weight refit: bucket packing, both transports across processes, and the synchronizer through Ray."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from rlcore.refit import RefitError, WeightSynchronizer, metadata_of, plan_buckets
from rlcore.refit.buckets import ALIGN, buffer_bytes, pack, unpack


def sample_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(50, 16, generator=g),
        "layer.0.bias": torch.randn(7, generator=g).to(torch.bfloat16),
        "big.weight": torch.randn(300, 40, generator=g),  # larger than a bucket: gets its own
        "steps": torch.tensor(3, dtype=torch.int64),
        "norm.weight": torch.randn(16, generator=g).to(torch.float16),
    }


def test_pack_unpack_round_trip_is_exact():
    tensors = sample_tensors()
    meta = metadata_of(tensors.items())
    plan = plan_buckets(meta, bucket_bytes=4096)
    assert [n for b in plan for n in b.names] == list(tensors)  # order kept, every tensor once
    assert any(b.names == ("big.weight",) for b in plan) and all(o % ALIGN == 0 for b in plan for o in b.offsets)
    buffer = torch.empty(buffer_bytes(plan), dtype=torch.uint8)
    source = iter(tensors.items())
    for bucket in plan:
        pack(bucket, source, buffer, meta)
        for name, t in unpack(bucket, buffer, meta):
            assert t.dtype == tensors[name].dtype and torch.equal(t, tensors[name])


def test_pack_rejects_a_sender_out_of_order():
    tensors = sample_tensors()
    meta = metadata_of(tensors.items())
    plan = plan_buckets(meta, bucket_bytes=1 << 20)
    shuffled = iter(reversed(list(tensors.items())))
    with pytest.raises(RefitError, match="iteration order must match"):
        pack(plan[0], shuffled, torch.empty(buffer_bytes(plan), dtype=torch.uint8), meta)


def layered_metadata(layer_sizes: list[int]) -> dict:
    """``model.embed_tokens`` then decoder layers of 3 tensors each (``layer_sizes[i]`` floats per tensor)."""
    meta = {"model.embed_tokens.weight": ((64,), "float32")}
    for i, n in enumerate(layer_sizes):
        for part in ("self_attn.qkv", "mlp.up", "mlp.down"):
            meta[f"model.layers.{i}.{part}.weight"] = ((n,), "float32")
    meta["model.norm.weight"] = ((64,), "float32")
    return meta


def test_buckets_are_cut_between_layers_and_only_oversized_layers_split():
    from rlcore.refit.buckets import layer_of, split_layer_names

    meta = layered_metadata([256, 256, 256, 2048, 256])  # 3 KiB layers, one 24 KiB layer
    plan = plan_buckets(meta, bucket_bytes=8 << 10)
    assert [n for b in plan for n in b.names] == list(meta)  # order kept, nothing lost
    buckets_of: dict[str, set[int]] = {}
    for index, bucket in enumerate(plan):
        assert bucket.size <= 8 << 10
        for name in bucket.names:
            buckets_of.setdefault(layer_of(name), set()).add(index)
    spanning = {layer for layer, where in buckets_of.items() if len(where) > 1}
    assert spanning == {"model.layers.3"}  # only the layer larger than a bucket is split
    assert split_layer_names(plan) == {n for n in meta if n.startswith("model.layers.3.")}
    # [embed, layer 0, layer 1] [layer 2] [layer 3's tensors, one bucket each: 3] [layer 4, norm]
    assert len(plan) == 6 and plan[1].names[0] == "model.layers.2.self_attn.qkv.weight"
    # A view of a whole layer is a view; a split layer's tensors are copies.
    buffer = torch.zeros(buffer_bytes(plan), dtype=torch.uint8)
    first = dict(unpack(plan[0], buffer, meta, copy=split_layer_names(plan)))
    assert first["model.layers.0.mlp.up.weight"].untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    third = dict(unpack(plan[2], buffer, meta, copy=split_layer_names(plan)))
    assert all(t.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr() for t in third.values())


# -- transports across real processes --------------------------------------------------------


def _shm_sender(address, authkey, drop: str | None, queue) -> None:
    from rlcore.refit.shared_memory import stream_to_receiver

    tensors = sample_tensors()
    if drop:
        tensors.pop(drop)
    try:
        sent = stream_to_receiver(
            iter(tensors.items()),
            metadata_of(tensors.items()),
            address,
            authkey,
            bucket_bytes=2048,
            device=torch.device("cpu"),
        )
        queue.put(("ok", sent))
    except Exception as exc:  # noqa: BLE001 - reported to the test process
        queue.put(("error", str(exc)))


def _receive_shm(got: dict[str, torch.Tensor], drop: str | None = None):
    from rlcore.refit.shared_memory import ShmReceiver

    ctx = mp.get_context("spawn")
    receiver = ShmReceiver()
    queue = ctx.Queue()
    sender = ctx.Process(target=_shm_sender, args=(receiver.address, receiver.authkey, drop, queue))
    sender.start()
    try:
        stats = receiver.receive(
            metadata_of(sample_tensors().items()),
            lambda named: got.update({n: t.clone() for n, t in named}),
            timeout_s=60,
        )
        return stats, queue.get(timeout=60)
    finally:
        sender.join(timeout=60)
        receiver.close()


def test_shared_memory_stream_delivers_every_tensor():
    got: dict[str, torch.Tensor] = {}
    stats, (status, sent) = _receive_shm(got)
    assert status == "ok" and stats.tensors == 5 and stats.buckets > 2 and sent == stats.bytes
    for name, t in sample_tensors().items():
        assert torch.equal(got[name], t)


def test_shared_memory_stream_rejects_a_missing_tensor_before_loading_anything():
    got: dict[str, torch.Tensor] = {}
    with pytest.raises(RefitError, match="rejected before any weight was changed: missing 1 tensor.*norm.weight"):
        _receive_shm(got, drop="norm.weight")
    assert got == {}


def _shm_sender_twice(address, authkey, queue) -> None:
    from rlcore.refit.shared_memory import stream_to_receiver

    for scale in (1.0, 2.0):
        tensors = {k: v * scale if v.is_floating_point() else v for k, v in sample_tensors().items()}
        stream_to_receiver(
            iter(tensors.items()),
            metadata_of(tensors.items()),
            address,
            authkey,
            bucket_bytes=2048,
            device=torch.device("cpu"),
        )
    queue.put("ok")


def test_the_receiver_maps_a_senders_pooled_buffers_once():
    from rlcore.refit.shared_memory import ShmReceiver

    ctx = mp.get_context("spawn")
    receiver, queue = ShmReceiver(), ctx.Queue()
    sender = ctx.Process(target=_shm_sender_twice, args=(receiver.address, receiver.authkey, queue))
    sender.start()
    mapped, got = [], []
    try:
        for _ in range(2):
            into: dict[str, torch.Tensor] = {}
            receiver.receive(
                metadata_of(sample_tensors().items()),
                lambda named, into=into: into.update({n: t.clone() for n, t in named}),
                timeout_s=60,
            )
            got.append(into)
            mapped.append(dict(receiver._mapped))
        assert queue.get(timeout=60) == "ok"
    finally:
        sender.join(timeout=60)
        receiver.close()
    assert len(mapped[0]) == 2 and all(mapped[1][k] is v for k, v in mapped[0].items())  # the same two mappings
    assert receiver._mapped == {}
    for name, t in sample_tensors().items():
        assert torch.equal(got[0][name], t) and torch.equal(got[1][name], t * 2 if t.is_floating_point() else t)


def _collective_sender(port: int, queue) -> None:
    from rlcore.refit.collective import broadcast_weights, init_refit_group

    group = init_refit_group("127.0.0.1", port, 2, 0, torch.device("cpu"))
    tensors = sample_tensors()
    queue.put(broadcast_weights(group, iter(tensors.items()), metadata_of(tensors.items()), 2048, torch.device("cpu")))


def test_collective_broadcast_delivers_every_tensor():
    import socket

    from rlcore.refit.collective import init_refit_group, receive_weights

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    sender = ctx.Process(target=_collective_sender, args=(port, queue))
    sender.start()
    try:
        group = init_refit_group("127.0.0.1", port, 2, 1, torch.device("cpu"), timeout_s=60)
        got: dict[str, torch.Tensor] = {}
        received = receive_weights(
            group,
            metadata_of(sample_tensors().items()),
            2048,
            torch.device("cpu"),
            lambda named: got.update({n: t.clone() for n, t in named}),
        )
        assert received == queue.get(timeout=60)
    finally:
        sender.join(timeout=60)
    for name, t in sample_tensors().items():
        assert torch.equal(got[name], t)


def _silent_member(port: int, joined) -> None:
    """A refit group member that joins and then takes no part (an engine stuck, or gone quiet mid-stream)."""
    import time

    from rlcore.refit.collective import init_refit_group

    group = init_refit_group("127.0.0.1", port, 2, 1, torch.device("cpu"), timeout_s=60)
    joined.set()
    time.sleep(60)
    del group


def test_a_refit_broadcast_to_a_member_that_takes_no_part_fails_within_the_group_timeout():
    """Every collective of the refit group has a deadline (``timeout_s``; the backends' default is 30 min):
    a sender whose engine stops taking part gets an error, not a wait without end."""
    import socket
    import time

    from rlcore.refit.collective import broadcast_weights, init_refit_group

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    joined = ctx.Event()
    member = ctx.Process(target=_silent_member, args=(port, joined), daemon=True)
    member.start()
    try:
        group = init_refit_group("127.0.0.1", port, 2, 0, torch.device("cpu"), timeout_s=2)
        assert joined.wait(60)
        tensors = sample_tensors()
        began = time.monotonic()
        with pytest.raises(RuntimeError, match="(?i)timed out|timeout"):
            broadcast_weights(group, iter(tensors.items()), metadata_of(tensors.items()), 2048, torch.device("cpu"))
        assert time.monotonic() - began < 30
    finally:
        member.kill()
        member.join(timeout=30)


# -- the synchronizer through Ray, from a real Policy ----------------------------------------


@pytest.mark.parametrize("transport", ["shared_memory", "collective"])
def test_synchronizer_moves_trained_weights(transport, ray_session, tiny_model_dir, tiny_tokenizer):
    from rlcore.algorithms.loss_functions import NLLLoss
    from rlcore.config import load_config_dict
    from rlcore.data import BatchedDataDict
    from rlcore.distributed import RayVirtualCluster
    from rlcore.policy import Policy
    from rlcore.testing.models import make_batch
    from tests.support.refit_fakes import RecordingGeneration

    cfg = load_config_dict(
        {
            "policy": {
                "backend": "reference",
                "model_name": tiny_model_dir,
                "train_global_batch_size": 2,
                "optimizer": {"name": "SGD", "kwargs": {"lr": 0.5}},
            }
        }
    ).policy
    cluster = RayVirtualCluster([2], max_colocated_worker_groups=2)
    policy = Policy(cluster, cfg, tiny_tokenizer)
    generation = RecordingGeneration(RayVirtualCluster([1]) if transport == "collective" else cluster)
    try:
        policy.train(BatchedDataDict(make_batch(tiny_tokenizer, 2, 4, 12)), NLLLoss())
        sync = WeightSynchronizer(
            policy, generation, colocated=transport == "shared_memory", cluster=cluster, bucket_bytes=32 << 10
        )
        assert sync.transport == transport
        stats = sync.sync_weights()
        expected = policy.worker_group.get_results(policy.worker_group.run_all_workers_single_data("state_dict_cpu"))[0]
        got = generation.received()
        assert set(got) == set(expected) and stats["bytes"] > 0 and not sync.stale
        for name, t in expected.items():
            assert torch.equal(got[name], t), name
    finally:
        generation.shutdown()
        policy.shutdown()
        cluster.shutdown()


def _cuda_sender(address, authkey, queue) -> None:
    from rlcore.refit.shared_memory import stream_to_receiver

    tensors = {k: v.cuda() for k, v in sample_tensors().items()}
    queue.put(
        stream_to_receiver(
            iter(tensors.items()),
            metadata_of(tensors.items()),
            address,
            authkey,
            bucket_bytes=2048,
            device=torch.device("cuda"),
        )
    )


@pytest.mark.gpu
def test_cuda_ipc_stream_delivers_every_tensor():
    """On a GPU the colocated transport shares CUDA buffers by IPC handle instead of POSIX shared memory."""
    from rlcore.refit.shared_memory import ShmReceiver

    ctx = mp.get_context("spawn")
    receiver, queue = ShmReceiver(), ctx.Queue()
    sender = ctx.Process(target=_cuda_sender, args=(receiver.address, receiver.authkey, queue))
    sender.start()
    got: dict[str, torch.Tensor] = {}
    try:
        receiver.receive(
            metadata_of(sample_tensors().items()),
            lambda named: got.update({n: t.clone() for n, t in named}),
            timeout_s=120,
        )
        assert queue.get(timeout=60) > 0
    finally:
        sender.join(timeout=60)
        receiver.close()
    for name, t in sample_tensors().items():
        assert got[name].is_cuda and torch.equal(got[name].cpu(), t)


def test_a_vision_blocks_tensors_count_as_one_layer():
    """vLLM fuses a vision block's gate/up projections as it does a decoder layer's: the plan keeps the block
    together (or copies it) just the same."""
    from rlcore.refit.buckets import layer_of

    assert layer_of("model.visual.blocks.7.mlp.gate_proj.weight") == "model.visual.blocks.7"
    assert layer_of("model.language_model.layers.2.mlp.up_proj.weight") == "model.language_model.layers.2"
    assert layer_of("model.visual.merger.mlp.0.weight") == "model.visual.merger.mlp.0.weight"
