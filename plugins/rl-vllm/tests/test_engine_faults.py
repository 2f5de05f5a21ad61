"""Faults around real vLLM engines: a process killed mid-generate or mid-refit is named, promptly, and nothing hangs.

Each test gets a fresh one-bundle colocated placement (a ``reference`` training rank and one
engine), since it kills one of them. The session's leak check then verifies that nothing of the
killed processes (shared memory, sockets, temp dirs, processes) outlived them.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray
import torch

from rl_vllm.generation import VllmGeneration
from rl_vllm.refit import EngineStaleError
from rlcore.config import load_config_dict
from rlcore.data import BatchedDataDict
from rlcore.distributed import WorkerError
from rlcore.refit import RefitError, WeightSynchronizer
from rlcore.testing.models import make_batch
from rlcore.testing.pytest_plugin import ClusterPool

#: A named error must arrive within this many seconds of the kill.
PROMPT_S = 10.0


@pytest.fixture
def pair(ray_session: None, tiny_model_dir: str, tiny_tokenizer: Any) -> Iterator[dict]:
    from rlcore.policy import Policy

    cfg = load_config_dict(
        {
            "cluster": {"workers_per_node": 1},
            "policy": {
                "backend": "reference",
                "model_name": tiny_model_dir,
                "precision": "float32",
                "train_global_batch_size": 2,
                "train_micro_batch_size": 1,
                "max_total_sequence_length": 64,
                "generation": {
                    "backend": "vllm",
                    "max_new_tokens": 8,
                    "pad_token_id": tiny_tokenizer.pad_token_id,
                    "vllm_cfg": {"kv_cache_space_gb": 0.0625, "max_model_len": 128},
                },
            },
        }
    ).policy
    clusters = ClusterPool()
    cluster = clusters(1, max_colocated_worker_groups=2)
    policy = generation = None
    try:
        policy = Policy(cluster, cfg, tiny_tokenizer, name_prefix="faulty", init_reference_model=False)
        generation = VllmGeneration(cluster, cfg.generation, name_prefix="faulty-vllm")
        sync = WeightSynchronizer(policy, generation, colocated=True, bucket_bytes=4096)
        sync.sync_weights()  # metadata exchanged, receivers created: the next refit is a plain one
        yield {"policy": policy, "generation": generation, "sync": sync, "tokenizer": tiny_tokenizer}
    finally:
        for owner in (generation, policy):
            if owner is not None:
                owner.shutdown()
        clusters.shutdown()


def prompts(tokenizer: Any) -> BatchedDataDict:
    raw = make_batch(tokenizer, 2, 3, 8, seed=0)
    return BatchedDataDict(input_ids=raw["input_ids"], input_lengths=raw["input_lengths"])


def kill_later(pid: int, delay_s: float) -> list[float]:
    """SIGKILL ``pid`` after ``delay_s``; the list receives the kill time."""
    when: list[float] = []

    def kill() -> None:
        when.append(time.monotonic())
        os.kill(pid, signal.SIGKILL)

    threading.Timer(delay_s, kill).start()
    return when


def test_an_engine_killed_mid_generate_is_named(pair: dict) -> None:
    engine = pair["generation"].worker_group.worker_pids()[0]
    os.kill(engine, signal.SIGSTOP)  # the request below is in the engine's hands when it dies
    killed = kill_later(engine, 1.0)
    with pytest.raises(WorkerError, match=r"worker faulty-vllm-rank0 \(rank 0\) died"):
        pair["generation"].generate(prompts(pair["tokenizer"]), greedy=True)
    print(f"engine SIGKILL mid-generate: named error after {time.monotonic() - killed[0]:.2f}s")
    assert time.monotonic() - killed[0] < PROMPT_S


def test_a_training_rank_killed_before_it_sends_is_named_by_the_refit(pair: dict) -> None:
    os.kill(pair["policy"].worker_group.worker_pids()[0], signal.SIGKILL)
    killed = time.monotonic()
    with pytest.raises(RefitError, match=r"refit failed: worker faulty-reference-rank0 \(rank 0\) died"):
        pair["sync"].sync_weights()
    print(f"training rank SIGKILL at refit: named error after {time.monotonic() - killed:.2f}s")
    assert time.monotonic() - killed < PROMPT_S


def test_an_engine_killed_mid_stream_fails_its_sender_at_once(pair: dict) -> None:
    generation = pair["generation"]
    info = pair["policy"].prepare_refit_info()
    weights = {name: torch.zeros(shape, dtype=getattr(torch, dtype)) for name, (shape, dtype) in info.items()}
    engine = generation.worker_group.worker_pids()[0]
    killed: list[float] = []

    def dies_half_way() -> Iterator[tuple[str, torch.Tensor]]:
        for i, name in enumerate(info):
            if i == len(info) // 2:
                killed.append(time.monotonic())
                os.kill(engine, signal.SIGKILL)
            yield name, weights[name]

    from rlcore.refit.shared_memory import stream_to_receiver

    address, key = generation.refit_endpoints()[0]
    receiver = generation.update_weights_via_ipc_zmq()[0]
    with pytest.raises((RefitError, EOFError, OSError)):
        stream_to_receiver(dies_half_way(), info, address, key, 4096, torch.device("cpu"))
    print(f"engine SIGKILL mid-stream: sender failed after {time.monotonic() - killed[0]:.2f}s")
    assert time.monotonic() - killed[0] < PROMPT_S
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(receiver, timeout=PROMPT_S)


def _sender_that_dies(address: str, key: bytes, info: dict) -> None:
    from rlcore.refit.shared_memory import stream_to_receiver

    def dies_half_way() -> Iterator[tuple[str, torch.Tensor]]:
        for i, (name, (shape, dtype)) in enumerate(info.items()):
            if i == len(info) // 2:
                os.kill(os.getpid(), signal.SIGKILL)
            yield name, torch.zeros(shape, dtype=getattr(torch, dtype))

    stream_to_receiver(dies_half_way(), info, address, key, 4096, torch.device("cpu"))


def test_a_sender_killed_mid_stream_leaves_the_engine_stale_not_hung(pair: dict) -> None:
    generation = pair["generation"]
    info = pair["policy"].prepare_refit_info()
    address, key = generation.refit_endpoints()[0]
    receiver = generation.update_weights_via_ipc_zmq()[0]
    sender = mp.get_context("spawn").Process(target=_sender_that_dies, args=(address, key, info))
    sender.start()
    sender.join(timeout=120)
    assert sender.exitcode == -signal.SIGKILL
    died = time.monotonic()
    with pytest.raises(ray.exceptions.RayTaskError, match="RefitError"):
        ray.get(receiver, timeout=PROMPT_S)
    print(f"sender SIGKILL mid-stream: engine's refit failed after {time.monotonic() - died:.2f}s")
    with pytest.raises(EngineStaleError, match="failed part-way"):
        generation.generate(prompts(pair["tokenizer"]), greedy=True)
    pair["sync"].sync_weights()  # the engine is usable again after a good refit
    generation.generate(prompts(pair["tokenizer"]), greedy=True)
