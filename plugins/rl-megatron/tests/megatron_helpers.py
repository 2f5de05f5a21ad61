"""Shared helpers of the rl-megatron tests: tiny models, configs, policies, oracles."""

from __future__ import annotations

from typing import Any

import torch

from rlcore.testing.conformance import hf_token_logprobs, load_hf_model

#: SGD exactly (no momentum, no weight decay): the single-process oracle applies ``w -= lr * grad``.
PLAIN_SGD = {
    "optimizer": {"optimizer": "sgd", "sgd_momentum": 0.0, "weight_decay": 0.0},
    "scheduler": {"start_weight_decay": 0.0, "end_weight_decay": 0.0},
}
SGD_LR = 0.5


def model_dir(arch: str = "llama", tied: bool = False, num_layers: int = 2) -> str:
    """A tiny HF model (cached on disk) with 4 query / 2 KV heads, so TP=2 can split it."""
    from rlcore.testing.models import tiny_model_path

    return tiny_model_path(arch=arch, tie_word_embeddings=tied, num_layers=num_layers, num_heads=4, num_kv_heads=2)


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def policy_config(
    model: str,
    world: int,
    *,
    gbs: int = 4,
    mbs: int = 1,
    lr: float = SGD_LR,
    max_grad_norm: float | None = None,
    megatron: dict | None = None,
    **policy: Any,
) -> Any:
    """A validated ``PolicyConfig`` for the megatron backend on ``world`` CPU ranks."""
    from rlcore.config import load_config_dict

    raw = {
        "backend": "megatron",
        "model_name": model,
        "train_global_batch_size": gbs,
        "train_micro_batch_size": mbs,
        "logprob_batch_size": 2,
        "learning_rate": lr,
        "max_grad_norm": max_grad_norm,
        "precision": "float32",
        "max_total_sequence_length": 32,
        "megatron_cfg": _merge(PLAIN_SGD, megatron or {}),
        **policy,
    }
    return load_config_dict({"cluster": {"workers_per_node": world}, "policy": raw}).policy


def batch(tokenizer: Any, size: int = 4, seed: int = 3) -> Any:
    from rlcore.data import BatchedDataDict
    from rlcore.testing.models import make_batch

    return BatchedDataDict(make_batch(tokenizer, size, 5, 16, seed=seed))


def hf_logprobs(model_path: str, data: Any) -> torch.Tensor:
    with torch.no_grad():
        return hf_token_logprobs(load_hf_model(model_path), data)


def hf_logits(model_path: str, data: Any) -> torch.Tensor:
    ids, lengths = data["input_ids"], data["input_lengths"]
    valid = torch.arange(ids.shape[1])[None, :] < lengths[:, None]
    with torch.no_grad():
        return load_hf_model(model_path)(input_ids=ids, attention_mask=valid.long()).logits.float()


def max_valid_diff(a: torch.Tensor, b: torch.Tensor, lengths: torch.Tensor) -> float:
    valid = torch.arange(a.shape[1])[None, :] < lengths[:, None]
    return float(((a - b).abs() * valid).max())


def state_of(path: str) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in load_hf_model(path).state_dict().items()}


def call_workers(policy: Any, method: str, *args: Any, **kwargs: Any) -> list[Any]:
    """Call a worker method that the ``Policy`` facade does not expose, on every rank."""
    group = policy.worker_group
    return group.get_results(group.run_all_workers_single_data(method, *args, **kwargs))
