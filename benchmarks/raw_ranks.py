"""The raw ranks and the Policy runner that ``scaling.py`` measures memory with (not a benchmark itself).

- :class:`RawRunner`: ``--world-size`` processes over gloo running a hand-written step of the same
  model on the same per-rank rows (FSDP2 per decoder layer and the root, or a full replica per rank),
  commanded 'train' / 'logprobs' so their peaks can be read beside rlcore's workers;
- :class:`PolicyRunner`: the same work through ``Policy``.

Step overhead (rlcore's step against a raw loop's) is measured by ``step_overhead.py``, not here.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

# Big enough that one training step takes about a second per rank on one CPU thread.
MODEL = dict(
    hidden_size=512,
    num_layers=8,
    num_heads=8,
    num_kv_heads=4,
    head_dim=64,
    intermediate_size=1408,
    max_position_embeddings=512,
)
SEQ_LEN = 256
ROWS_PER_RANK = 2
MICRO_BATCH = 1
LOGPROB_BATCH = 2
LR = 1e-3


def make_data(world_size: int) -> dict:
    from rlcore.testing.models import build_tiny_tokenizer, make_batch

    return make_batch(build_tiny_tokenizer(), ROWS_PER_RANK * world_size, SEQ_LEN - 32, SEQ_LEN, seed=0)


# --------------------------------------------------------------------------- raw torch


def _shard_fsdp2(model: Any, world_size: int) -> None:
    """Plain torch FSDP2: one unit per decoder layer plus the root, gradients summed over ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for module in model.modules():
        if isinstance(module, FSDPModule):  # sum over ranks, as the loss is normalised globally
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def _reduce_replicated_grads(params: list) -> None:
    """Full replicas: one flat all-reduce of every gradient, then the (unclipped) grad norm."""
    import torch
    import torch.distributed as dist

    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat)
    offset = 0
    for p in params:
        p.grad = flat[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
    torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))


def _sharded_grad_norm(params: list) -> None:
    """FSDP2 reduced the gradients in backward; the grad norm still needs one all-reduce over the shards."""
    import torch.distributed as dist

    norm_sq = sum(p.grad.to_local().double().square().sum() for p in params)
    dist.all_reduce(norm_sq)


def _raw_rank(rank: int, world_size: int, port: int, model_dir: str, fsdp2: bool, commands: list, results: Any) -> None:
    """One raw rank: runs 'train' / 'logprobs' commands until 'stop'; rank 0 reports times and losses.

    ``('train', batch)`` trains on a global batch the caller gives (``input_ids``, ``input_lengths``,
    ``token_mask``, ``sample_mask``) instead of :func:`make_data`'s: this rank takes its contiguous share
    of the rows (as rlcore's plain sharding does) and cuts each micro-batch to its longest row (as
    rlcore's plain micro-batches are).
    """
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if fsdp2:
        _shard_fsdp2(model, world_size)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=LR)
    data = make_data(world_size)
    rows = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)  # the rows plain dp sharding gives this rank
    mine = {k: v[rows] for k, v in data.items()}

    def logprobs(ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        valid = torch.arange(ids.shape[1])[None, :] < lengths[:, None]
        logits = model(input_ids=ids, attention_mask=valid.long(), use_cache=False).logits[:, :-1].float()
        lp = logits.gather(-1, ids[:, 1:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
        return torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1) * valid

    def train_step(given: dict | None = None) -> float:
        model.train()
        data = mine
        if given is not None:
            share = len(given["input_ids"]) // world_size
            data = {k: v[rank * share : (rank + 1) * share] for k, v in given.items()}
        mask = data["token_mask"][:, 1:] * data["sample_mask"][:, None]
        counts = torch.stack([data["sample_mask"].sum(), mask.sum()]).double()
        dist.all_reduce(counts)
        step_loss = torch.zeros((), dtype=torch.float64)
        for start in range(0, len(data["input_ids"]), MICRO_BATCH):
            mb = slice(start, start + MICRO_BATCH)
            width = data["input_ids"].shape[1] if given is None else int(data["input_lengths"][mb].max())
            lp = logprobs(data["input_ids"][mb, :width], data["input_lengths"][mb])
            loss = -(lp[:, 1:] * mask[mb, : width - 1]).sum() / counts[1].float()
            loss.backward()
            step_loss += loss.detach().double()
        dist.all_reduce(step_loss)
        (_sharded_grad_norm if fsdp2 else _reduce_replicated_grads)(params)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(step_loss)

    @torch.no_grad()
    def logprob_pass() -> None:
        model.eval()
        for s in range(0, ROWS_PER_RANK, LOGPROB_BATCH):
            logprobs(mine["input_ids"][s : s + LOGPROB_BATCH], mine["input_lengths"][s : s + LOGPROB_BATCH])

    work = {"train": train_step, "logprobs": logprob_pass}
    results.put(("ready", rank))
    while (command := commands[rank].get()) != "stop":
        name, *given = command if isinstance(command, tuple) else (command,)
        dist.barrier()
        t0 = time.perf_counter()
        out = work[name](*given)
        dist.barrier()
        if rank == 0:
            results.put((time.perf_counter() - t0, out))
    dist.destroy_process_group()


class RawRunner:
    """The raw ranks, kept alive between commands so their runs can be interleaved with rlcore's."""

    def __init__(self, model_dir: str, world_size: int, fsdp2: bool) -> None:
        import torch.multiprocessing as mp

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        self.commands = [ctx.SimpleQueue() for _ in range(world_size)]
        self.results = ctx.SimpleQueue()
        self.context = mp.start_processes(
            _raw_rank,
            args=(world_size, port, model_dir, fsdp2, self.commands, self.results),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        for _ in range(world_size):
            self.results.get()  # every rank has loaded the model

    def run(self, command: str | tuple) -> tuple[float, Any]:
        for queue in self.commands:
            queue.put(command)
        return self.results.get()

    def close(self) -> None:
        for queue in self.commands:
            queue.put("stop")
        while not self.context.join():
            pass


# --------------------------------------------------------------------------- through Policy


class PolicyRunner:
    """The same work through ``Policy``, timed in the driver."""

    def __init__(self, backend: str, model_dir: str, world_size: int) -> None:
        from rlcore.algorithms.sft.loss import NLLLoss
        from rlcore.config import load_config_dict
        from rlcore.data import BatchedDataDict
        from rlcore.distributed import RayVirtualCluster, init_ray
        from rlcore.policy import Policy
        from rlcore.testing.models import build_tiny_tokenizer

        init_ray(num_cpus=max(world_size, 2))
        cfg = load_config_dict(
            {
                "cluster": {"workers_per_node": world_size},
                "policy": {
                    "backend": backend,
                    "model_name": model_dir,
                    "train_global_batch_size": ROWS_PER_RANK * world_size,
                    "train_micro_batch_size": MICRO_BATCH,
                    "logprob_batch_size": LOGPROB_BATCH,
                    "learning_rate": LR,
                    "optimizer": {"name": "torch.optim.SGD", "kwargs": {"lr": LR}},
                    "max_grad_norm": None,
                    "precision": "float32",
                    "max_total_sequence_length": SEQ_LEN,
                },
            }
        ).policy
        self.cluster = RayVirtualCluster([world_size])
        self.policy = Policy(self.cluster, cfg, build_tiny_tokenizer(), init_reference_model=False)
        self.data = BatchedDataDict(make_data(world_size))
        self.loss_fn = NLLLoss()

    def run(self, command: str) -> tuple[float, Any]:
        t0 = time.perf_counter()
        if command == "train":
            out = float(self.policy.train(self.data, self.loss_fn)["loss"][0])
        else:
            out = self.policy.get_logprobs(self.data)
        return time.perf_counter() - t0, out

    def close(self) -> None:
        from rlcore.distributed import shutdown_ray

        self.policy.shutdown()
        self.cluster.shutdown()
        shutdown_ray()
