"""``dtensor_cfg.reshard_after_forward`` and ``reduce_grads``: the collectives a step issues, and the same numbers.

Two gloo ranks in spawned processes (no Ray) each build the real ``DTensorPolicyWorker`` four times,
once per combination of the two settings, on a tiny 2-layer model (FSDP2 units: 2 decoder layers and
the root), and train two SGD steps of K micro-batches (SGD: a weight's change is proportional to its
gradient, so rounding stays rounding; Adam's first steps divide by the gradient's own size).
The second step runs under the profiler, which counts the all-gathers and reduce-scatters it issued.
The counts are FSDP2's schedule:

- ``reshard_after_forward`` true: each micro-batch gathers every unit for its forward and each layer
  again for its backward (the root stays gathered between them): K * (3 + 2) all-gathers; false:
  every unit once per step: 3.
- ``reduce_grads`` per_micro_batch: every unit's gradient is reduce-scattered after each backward:
  K * 3; per_step: once, after the last micro-batch: 3.

The numbers: every combination's losses, gradient norms and final weights equal the FSDP2 default
(reshard, per micro-batch) to float32 rounding, and the first step's gradient norm equals a single-process
float64 computation of the same step.
"""

from __future__ import annotations

import itertools
import os
import pickle
import socket
import time

import pytest
import torch

K = 3  # micro-batches per step (rows per rank, one row each)
WORLD = 2
UNITS, LAYERS = 3, 2
SETTINGS = list(itertools.product((True, False), ("per_micro_batch", "per_step")))
EXPECTED = {  # (reshard_after_forward, reduce_grads) -> (all-gathers, reduce-scatters) in a step of K micro-batches
    (True, "per_micro_batch"): (K * (UNITS + LAYERS), K * UNITS),
    (True, "per_step"): (K * (UNITS + LAYERS), UNITS),
    (False, "per_micro_batch"): (UNITS, K * UNITS),
    (False, "per_step"): (UNITS, UNITS),
}


def _model_dir() -> str:
    from rlcore.models import tiny_model_path

    return tiny_model_path(
        arch="llama",
        hidden_size=64,
        num_layers=LAYERS,
        num_heads=2,
        num_kv_heads=1,
        head_dim=32,
        intermediate_size=128,
        vocab_size=320,
        max_position_embeddings=128,
    )


def _batch() -> dict:
    from rlcore.testing.models import make_batch

    return make_batch(320, K * WORLD, 6, 24, seed=7)


def _config(model_dir: str, reshard: bool, reduce_grads: str):
    from rlcore.config import load_config_dict

    return load_config_dict(
        {
            "cluster": {"workers_per_node": WORLD},
            "policy": {
                "backend": "dtensor",
                "model_name": model_dir,
                "train_global_batch_size": K * WORLD,
                "train_micro_batch_size": 1,
                "logprob_batch_size": 2,
                "precision": "float32",
                "max_grad_norm": 1.0,
                "max_total_sequence_length": 32,
                "optimizer": {"name": "torch.optim.SGD", "kwargs": {"lr": 0.5}},
                "dtensor_cfg": {"reshard_after_forward": reshard, "reduce_grads": reduce_grads},
            },
        }
    ).policy


def _collectives(fn) -> tuple[int, int]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    names = [e.name.lower() for e in prof.events() if e.name.startswith("c10d::")]
    return (sum("allgather" in n or "all_gather" in n for n in names), sum("reduce_scatter" in n for n in names))


def _rank(rank: int, port: int, model_dir: str, results) -> None:
    from rl_dtensor.worker import DTensorPolicyWorker
    from rlcore.algorithms.loss_functions import NLLLoss
    from rlcore.data import BatchedDataDict

    torch.set_num_threads(1)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    data = _batch()
    shard = BatchedDataDict({k: v[rank * K : (rank + 1) * K] for k, v in data.items()})
    out = {"seconds": []}
    for reshard, reduce_grads in SETTINGS:
        t0 = time.perf_counter()
        worker = DTensorPolicyWorker(_config(model_dir, reshard, reduce_grads), None, init_reference_model=False)
        first = worker.train(shard, NLLLoss(), gbs=K * WORLD, mbs=1)
        counted = {}
        train = worker.train
        counts = _collectives(lambda: counted.update(train(shard, NLLLoss(), gbs=K * WORLD, mbs=1)))
        lp = worker.get_logprobs(shard)["logprobs"]
        weights = worker.state_dict_cpu()
        out[(reshard, reduce_grads)] = dict(
            counts=counts,
            losses=first["losses"] + counted["losses"],
            norms=first["grad_norms"] + counted["grad_norms"],
            weights=weights,
            logprobs=lp,
        )
        out["seconds"].append(time.perf_counter() - t0)
        del worker  # the next one joins the same process group (shutdown would destroy it)
    if rank == 0:  # plain pickled bytes: shared-memory tensors would die with this process
        results.put(pickle.dumps(out))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _float64_first_grad_norm(model_dir: str) -> float:
    """The first step's gradient norm, one process, float64: the whole batch's token NLL / its valid tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    data = _batch()
    mask = data["token_mask"][:, 1:].double() * data["sample_mask"][:, None].double()
    total = torch.zeros((), dtype=torch.float64)
    for row in range(len(data["input_ids"])):
        width = int(data["input_lengths"][row])
        ids = data["input_ids"][row : row + 1, :width]
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
        lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        total = total - (lp * mask[row : row + 1, : width - 1]).sum()
    (total / mask.sum()).backward()
    return float(torch.sqrt(sum(p.grad.square().sum() for p in model.parameters())))


@pytest.fixture(scope="module")
def runs() -> dict:
    import torch.multiprocessing as mp

    model_dir = _model_dir()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, model_dir, results)) for r in range(WORLD)]
    for p in procs:
        p.start()
    import queue

    try:
        while True:  # a rank that dies fails the test now, not after a timeout
            try:
                out = pickle.loads(results.get(timeout=2))
                break
            except queue.Empty:
                assert all(p.is_alive() for p in procs), f"a rank exited: {[p.exitcode for p in procs]}"
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    out["model_dir"] = model_dir
    return out


@pytest.mark.parametrize("setting", SETTINGS, ids=[f"reshard_after_forward={r}-reduce_grads={g}" for r, g in SETTINGS])
def test_a_step_of_k_micro_batches_issues_these_all_gathers_and_reduce_scatters(runs, setting):
    all_gathers, reduce_scatters = runs[setting]["counts"]
    assert (all_gathers, reduce_scatters) == EXPECTED[setting], (
        f"{setting}: {all_gathers} all-gathers and {reduce_scatters} reduce-scatters in a step of {K} micro-batches, "
        f"expected {EXPECTED[setting]}"
    )


@pytest.mark.parametrize(
    "setting", SETTINGS[1:], ids=[f"reshard_after_forward={r}-reduce_grads={g}" for r, g in SETTINGS[1:]]
)
def test_the_settings_change_no_number(runs, setting):
    base, got = runs[SETTINGS[0]], runs[setting]
    assert got["losses"] == pytest.approx(base["losses"], rel=1e-6, abs=1e-7)
    assert got["norms"] == pytest.approx(base["norms"], rel=1e-5)
    for name, tensor in base["weights"].items():
        torch.testing.assert_close(got["weights"][name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    torch.testing.assert_close(got["logprobs"], base["logprobs"], rtol=1e-5, atol=1e-5)


def test_the_first_step_gradient_norm_equals_a_float64_reference(runs):
    expected = _float64_first_grad_norm(runs["model_dir"])
    for setting in SETTINGS:
        assert runs[setting]["norms"][0] == pytest.approx(expected, rel=1e-5), setting
