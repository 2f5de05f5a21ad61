"""The single-process oracles of the conformance kit: plain Hugging Face float32 in this process.

Written independently of the backends' helpers on purpose (no rlcore.training
code): the kit compares every backend with these. Heavy imports (torch,
transformers) stay inside the functions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def hf_token_logprobs(model: Any, data: Any) -> "torch.Tensor":
    """Token logprobs of a plain Hugging Face forward, aligned as design.md §2.2 says.

    Written independently of the backends' helpers on purpose: it is the oracle.
    """
    import torch

    ids, lengths = data["input_ids"], data["input_lengths"]
    positions = torch.arange(ids.shape[1])[None, :]
    valid = positions < lengths[:, None]
    logits = model(input_ids=ids, attention_mask=valid.long(), use_cache=False).logits.float()
    next_lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    out = torch.cat([torch.zeros_like(next_lp[:, :1]), next_lp], dim=1)
    return torch.where(valid, out, torch.zeros_like(out))


def load_hf_model(path: str) -> Any:
    """``AutoModelForCausalLM.from_pretrained(path)`` in float32; fails if any weight was not in the files."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.utils.logging.disable_progress_bar()
    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    bad = {k: sorted(v) for k, v in info.items() if k != "error_msgs" and v}
    if bad or info.get("error_msgs"):
        raise AssertionError(f"checkpoint {path} does not load cleanly with AutoModelForCausalLM: "
                             f"{bad or info['error_msgs']}")
    return model


def state_copy(model: Any) -> dict:
    """A detached copy of ``model``'s state dict: the weights a step record keeps."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@dataclass
class StepRecord:
    """What one optimizer step produced."""

    loss: float
    grad_norm: float
    weights: dict = field(repr=False)


def single_process_sgd(model_dir: str, steps: list[tuple[Any, Any]], lr: float) -> tuple[dict, list[StepRecord]]:
    """The oracle: plain SGD steps on the whole batch in this process.

    ``steps`` is a list of ``(data, loss_fn)``; each is one optimizer step over
    all of ``data`` (one forward, no micro-batches, no ranks). Returns the
    initial weights and one :class:`StepRecord` per step.
    """
    import torch

    model = load_hf_model(model_dir)
    model.train()
    params = dict(model.named_parameters())
    initial = state_copy(model)
    records = []
    for data, loss_fn in steps:
        loss, grads = oracle_gradients(model, data, loss_fn)
        norm = math.sqrt(sum(float(g.double().square().sum()) for g in grads.values()))
        with torch.no_grad():
            for name, grad in grads.items():
                params[name] -= lr * grad
        records.append(StepRecord(loss, norm, state_copy(model)))
    return initial, records


def oracle_gradients(model: Any, data: Any, loss_fn: Any) -> tuple[float, dict]:
    """The loss of one optimizer step over all of ``data`` and ``{parameter name: gradient}`` (one forward)."""
    model.zero_grad(set_to_none=True)
    sample_mask = data["sample_mask"].float()
    seqs = sample_mask.sum()
    toks = (data["token_mask"][:, 1:].float() * sample_mask[:, None]).sum()
    loss, _ = loss_fn(hf_token_logprobs(model, data), data, seqs, toks)
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


__all__ = ["StepRecord", "hf_token_logprobs", "load_hf_model", "oracle_gradients", "single_process_sgd", "state_copy"]
