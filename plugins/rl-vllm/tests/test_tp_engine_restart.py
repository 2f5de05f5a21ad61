"""An engine of ``tensor_parallel_size`` 2 that loses one rank comes back whole (rlcore.run.engine_recovery).

One engine is two actors (one rank per bundle, vLLM's ``external_launcher``) meeting in a torch.distributed
group of their own: when one dies, the other is stuck in a dead group, so the whole engine (both ranks, their
group, their shared memory) is torn down and started again, refit, and only then serves.

One placement for the module: two ``reference`` training ranks and one TP-2 engine, colocated, behind the
run's own :class:`EngineRecovery` (what ``rlcore run`` builds). The reference is the policy's ``get_logprobs``
(float32, as ``test_refit_tp_engines.py``); the negative control is the same comparison against the engine's
checkpoint weights, which training moved away from.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from rlcore.config import load_config_dict
from rlcore.data import BatchedDataDict
from rlcore.testing.models import make_batch
from rlcore.testing.pytest_plugin import ClusterPool

#: Three TP-2 engine starts (one, then two restarts) beside two training ranks: minutes on 2 cores.
pytestmark = pytest.mark.slow

WORLD = 2
ATOL = 1e-4  # float32 engine over two ranks against the policy's float32 forward (test_refit_tp_engines.py)
BUCKET = 64 << 10
GONE_S = 30.0  # a dead engine's processes are gone within this many seconds of the restart


@pytest.fixture(scope="module")
def setup(ray_session: None, tiny_model_dir: str, tiny_tokenizer: Any) -> Iterator[dict[str, Any]]:
    from rl_vllm.generation import VllmGeneration
    from rlcore.policy import Policy
    from rlcore.refit import WeightSynchronizer
    from rlcore.run.engine_recovery import EngineRecovery

    cfg = load_config_dict(
        {
            "cluster": {"workers_per_node": WORLD},
            "policy": {
                "backend": "reference",
                "model_name": tiny_model_dir,
                "precision": "float32",
                "train_global_batch_size": 4,
                "train_micro_batch_size": 1,
                "max_total_sequence_length": 64,
                "optimizer": {"name": "torch.optim.SGD", "kwargs": {"lr": 0.5}},
                "max_grad_norm": None,
                "generation": {
                    "backend": "vllm",
                    "max_new_tokens": 6,
                    "pad_token_id": tiny_tokenizer.pad_token_id,
                    "vllm_cfg": {"kv_cache_space_gb": 0.0625, "max_model_len": 128, "tensor_parallel_size": 2},
                },
            },
        }
    ).policy
    clusters = ClusterPool()
    policy = recovery = None
    try:
        cluster = clusters(WORLD, max_colocated_worker_groups=2)
        policy = Policy(cluster, cfg, tiny_tokenizer, name_prefix="tp-restart", init_reference_model=False)

        def start() -> tuple[Any, Any]:  # as rlcore.run.build's start_engines
            generation = VllmGeneration(cluster, cfg.generation, name_prefix="tp-restart-vllm")
            return generation, WeightSynchronizer(policy, generation, colocated=True, bucket_bytes=BUCKET)

        generation, synchronizer = start()
        recovery = EngineRecovery(start, cluster, policy, 1, generation, synchronizer)
        yield {"policy": policy, "recovery": recovery, "tokenizer": tiny_tokenizer}
    finally:
        if recovery is not None:
            for owner in (recovery.synchronizer, recovery.generation):
                owner.shutdown()
        if policy is not None:
            policy.shutdown()
        clusters.shutdown()


def prompts(tokenizer: Any) -> BatchedDataDict:
    raw = make_batch(tokenizer, 4, 3, 8, seed=3)
    return BatchedDataDict(input_ids=raw["input_ids"], input_lengths=raw["input_lengths"])


def logprob_error(setup: dict[str, Any], out: BatchedDataDict) -> float:
    """Max |engine - policy| logprob over the tokens of ``out`` the engine generated."""
    seqs = BatchedDataDict(input_ids=out["output_ids"], input_lengths=out["unpadded_sequence_lengths"])
    expected = setup["policy"].get_logprobs(seqs)["logprobs"]
    positions = torch.arange(out["output_ids"].shape[1])[None, :]
    lengths = prompts(setup["tokenizer"])["input_lengths"]
    generated = (positions >= lengths[:, None]) & (positions < out["unpadded_sequence_lengths"][:, None])
    assert bool(generated.any()), "nothing was generated: the comparison would be vacuous"
    return float((out["logprobs"] - expected)[generated].abs().max())


def train_one_step(setup: dict[str, Any], seed: int) -> None:
    from rlcore.algorithms.loss_functions import NLLLoss

    setup["policy"].train(BatchedDataDict(make_batch(setup["tokenizer"], 4, 5, 16, seed=seed)), NLLLoss())


def engine_pids(recovery: Any) -> list[int]:
    return [info["pid"] for info in recovery.generation.engine_info]


def wait_gone(pids: list[int], timeout_s: float = GONE_S) -> list[int]:
    """The pids of ``pids`` still running (not zombies) after up to ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [p for p in pids if _running(p)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.2)


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def engine_files(pids: list[int]) -> dict[str, list[str]]:
    """What the live engine processes ``pids`` hold outside themselves: the IPC socket files in their own
    directories (``rl_vllm.engine_env.use_private_ipc_dir``), the /dev/shm segments they map that still have a
    name there (``segments``) and those whose name is already gone (``unnamed``)."""
    sockets, segments = [], set()
    for pid in pids:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        env = dict(v.decode().split("=", 1) for v in environ if b"=" in v)
        folder = Path(env["TMPDIR"], f"rlvllm-{pid}")  # the actor's temp dir: the private Ray's, as Ray sets it
        assert folder.is_dir(), f"engine rank {pid} has no IPC socket directory {folder}"
        sockets += [str(p) for p in folder.iterdir() if p.is_socket()]
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            if "/dev/shm/" in line:
                segments.add(line.split("/dev/shm/", 1)[1].split(" ")[0])
    named = sorted(s for s in segments if Path("/dev/shm", s).exists())
    return {"sockets": sorted(sockets), "segments": named, "unnamed": sorted(segments - set(named))}


def left_behind(files: dict[str, list[str]], pids: list[int], timeout_s: float = GONE_S) -> list[str]:
    """Of ``files`` (:func:`engine_files` of the dead engine ``pids``), what is still there after up to
    ``timeout_s``: the socket files and their directories, the shared-memory segments."""
    deadline = time.monotonic() + timeout_s
    while True:
        there = [p for p in files["sockets"] if os.path.lexists(p)]
        there += [str(Path(p).parent) for p in files["sockets"] if Path(p).parent.exists()]
        there += [f"/dev/shm/{s}" for s in files["segments"] if Path("/dev/shm", s).exists()]
        if not there or time.monotonic() >= deadline:
            return sorted(set(there))
        time.sleep(0.2)


def test_a_rank_killed_between_steps_brings_the_whole_engine_back_refit(setup: dict[str, Any]) -> None:
    """Rank 1 dies while the engine is idle; the step's refit finds it: both ranks are replaced, the new engine
    is refit with the trained weights, its logprobs are the policy's, and nothing of the dead engine is left."""
    from rlcore.run.engine_recovery import RestartingGeneration, RestartingSynchronizer

    recovery = setup["recovery"]
    sync, gen = RestartingSynchronizer(recovery), RestartingGeneration(recovery)
    sync.sync_weights()
    old = engine_pids(recovery)
    assert len(set(old)) == 2, "each rank of the engine is its own process"
    files = engine_files(old)
    assert files["sockets"] and files["unnamed"], f"the engine holds no IPC socket or shared memory: {files}"
    # The ranks' segments (all-reduce, message queue) lose their names once the engine is up: a rank that is
    # killed leaves nothing in /dev/shm, whoever ends its peers.
    assert not files["segments"], f"shared memory of a running engine still named in /dev/shm: {files}"
    train_one_step(setup, seed=11)
    checkpoint_error = logprob_error(setup, recovery.generation.generate(prompts(setup["tokenizer"]), greedy=True))
    assert checkpoint_error > 1e-3, "training did not move the policy: the comparison below would be vacuous"

    os.kill(old[1], signal.SIGKILL)
    assert not wait_gone([old[1]]), "SIGKILL did not end engine rank 1"
    sync.sync_weights()  # the step's refit: finds the dead rank, restarts the engine, refits it

    assert recovery.restarts == 1
    assert not wait_gone(old), "the surviving rank of the dead engine was left running"
    new = engine_pids(recovery)
    assert len(set(new)) == 2 and not set(new) & set(old)
    err = logprob_error(setup, gen.generate(prompts(setup["tokenizer"]), greedy=True))
    assert err <= ATOL, f"the restarted engine's logprobs differ from the policy's by {err:.3g}"
    assert not left_behind(files, old)
    recovery.end_step()


def test_a_rank_killed_mid_generation_restarts_an_engine_that_serves_only_after_its_refit(
    setup: dict[str, Any],
) -> None:
    """Rank 0 (the one that binds the engine's IPC sockets) dies with a request in the engine's hands. The
    restarted engine holds the checkpoint's weights, not the policy's: it refuses to serve until it is refit;
    then the lost request is answered with the policy's logprobs, and the dead rank's sockets are gone."""
    from rlcore.run.engine_recovery import EnginesNotRefitError, RestartingGeneration

    recovery = setup["recovery"]
    gen = RestartingGeneration(recovery)
    old, restarts = engine_pids(recovery), recovery.restarts
    files = engine_files(old)
    assert files["sockets"], "rank 0 binds no IPC socket: the check below would be vacuous"
    batch = prompts(setup["tokenizer"])
    pending = gen.generate_async(batch, greedy=True)
    os.kill(old[0], signal.SIGKILL)
    with pytest.raises(Exception) as died:
        pending.backend.collect(pending.handle)
    assert recovery.recover(died.value), "an engine rank's death was not taken for one"
    assert recovery.restarts == restarts + 1
    with pytest.raises(EnginesNotRefitError, match="not been refit since they were restarted"):
        gen.generate(batch, greedy=True)
    with pytest.raises(EnginesNotRefitError):
        gen.generate_async(batch, greedy=True)
    recovery.refit_and_wake(wake=True)
    err = logprob_error(setup, gen.generate(batch, greedy=True))
    assert err <= ATOL, f"the restarted engine's logprobs differ from the policy's by {err:.3g}"
    assert not wait_gone(old), "a rank of the dead engine was left running"
    assert not left_behind(files, old)
