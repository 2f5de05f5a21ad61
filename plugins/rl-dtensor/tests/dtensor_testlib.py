"""Helpers shared by the rl-dtensor tests (imported by basename: pytest puts this directory on sys.path).

The tests compare a real multi-rank ``Policy`` (Ray actors, gloo) with a
single-process Hugging Face float32 model. Policies are expensive to start
(a Ray actor per rank, torch/transformers imports, the model build), so each
test module starts the few it needs once and reuses them; tests that change
weights first put the initial ones back with ``load_checkpoint``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from rlcore.config import load_config_dict
from rlcore.data import BatchedDataDict
from rlcore.testing.conformance import StepRecord, hf_token_logprobs, load_hf_model, single_process_sgd
from rlcore.testing.models import make_batch, tiny_model_path

#: SGD learning rate: large, so one step visibly moves every weight.
LR = 0.5
#: Global batch of the tests' optimizer steps (4 per dp rank at dp=2).
GBS = 8

BATCHING = {
    "dynamic": {
        "dynamic_batching": {
            "enabled": True,
            "train_mb_tokens": 32,
            "logprob_mb_tokens": 48,
            "sequence_length_round": 4,
        }
    },
    "packing": {"sequence_packing": {"enabled": True, "train_mb_tokens": 40, "logprob_mb_tokens": 48}},
}


def model_dir(arch: str = "llama", **kwargs: Any) -> str:
    """A tiny model with 4 query and 2 KV heads, so tp=2 splits both."""
    return tiny_model_path(arch=arch, num_heads=4, num_kv_heads=2, **kwargs)


def policy_config(
    model: str, world: int = 2, tp: int = 1, sp: bool = False, use_gpu: bool = False, **policy: Any
) -> Any:
    raw = {
        "backend": "dtensor",
        "model_name": model,
        "train_global_batch_size": GBS,
        "train_micro_batch_size": 1,
        "logprob_batch_size": 2,
        "max_grad_norm": None,
        "precision": "float32",
        "max_total_sequence_length": 32,
        "optimizer": {"name": "torch.optim.SGD", "kwargs": {"lr": LR}},
        "dtensor_cfg": {"tensor_parallel_size": tp, "sequence_parallel": sp},
    }
    raw.update(policy)
    return load_config_dict({"cluster": {"workers_per_node": world, "use_gpu": use_gpu}, "policy": raw}).policy


def batch(tokenizer: Any, size: int = GBS, seed: int = 1234) -> BatchedDataDict:
    return BatchedDataDict(make_batch(tokenizer, size, 5, 16, seed=seed))


def hf_logprobs(model_path: str, data: Any) -> torch.Tensor:
    with torch.no_grad():
        return hf_token_logprobs(load_hf_model(model_path), data)


def oracle_step(model_path: str, data: Any, loss_fn: Any) -> tuple[dict, StepRecord]:
    """One plain SGD step on the whole batch in this process: (initial weights, the step's record)."""
    initial, records = single_process_sgd(model_path, [(data, loss_fn)], LR)
    return initial, records[0]


def oracle_clipped_step(model_path: str, data: Any, loss_fn: Any, max_norm: float) -> StepRecord:
    """One SGD step on the whole batch with the gradient norm clipped to ``max_norm`` (norm before clipping)."""
    model = load_hf_model(model_path)
    model.train()
    sample_mask = data["sample_mask"].float()
    tokens = (data["token_mask"][:, 1:].float() * sample_mask[:, None]).sum()
    loss, _ = loss_fn(hf_token_logprobs(model, data), data, sample_mask.sum(), tokens)
    loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
    return StepRecord(float(loss.detach()), norm, {k: v.detach().clone() for k, v in model.state_dict().items()})


def call_all(policy: Any, method: str, *args: Any, **kwargs: Any) -> list[Any]:
    wg = policy.worker_group
    return wg.get_results(wg.run_all_workers_single_data(method, *args, **kwargs))


def full_weights(policy: Any) -> dict[str, torch.Tensor]:
    """The policy's full, HF-named float32 weights (gathered from the shards)."""
    return call_all(policy, "state_dict_cpu")[0]


def reset_weights(policy: Any, path: str) -> None:
    """Load an HF checkpoint into every rank's shards (the tests' way back to the initial weights)."""
    call_all(policy, "load_checkpoint", path)


@contextlib.contextmanager
def batching(policy: Any, mode: str) -> Iterator[None]:
    """Run the policy with dynamic batching or sequence packing switched on for a while.

    Only the driver reads these settings (its batch plan, ``policy.resolved.batch``: it shards the data and
    passes ``mode=`` to the workers, which read nothing else), so swapping the driver's plan is equivalent to
    starting a policy with them, and saves a start.
    """
    if mode == "plain":
        yield
        return
    import dataclasses

    from rlcore.config import BatchPlan

    original = policy.resolved
    cfg = original.config.model_copy(
        update={key: type(getattr(original.config, key)).model_validate(value) for key, value in BATCHING[mode].items()}
    )
    plan = BatchPlan.of(cfg, original.batch.data_parallel_size, packing=mode == "packing")
    assert plan.mode == mode, (plan.mode, mode)
    policy.resolved = dataclasses.replace(original, batch=plan)
    try:
        yield
    finally:
        policy.resolved = original


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, str]:
    assert set(a) == set(b), f"names differ: {sorted(set(a) ^ set(b))}"
    return max(((a[k].double() - b[k].double()).abs().max().item(), k) for k in a)


def valid_diff(lp: torch.Tensor, expected: torch.Tensor, lengths: torch.Tensor) -> float:
    assert lp.shape == expected.shape and lp.dtype == torch.float32, (lp.shape, lp.dtype)
    valid = torch.arange(lp.shape[1])[None, :] < lengths[:, None]
    assert (lp[:, 0] == 0).all() and (lp[~valid] == 0).all(), "position 0 and padding must be 0"
    return float((lp - expected).abs().max())
