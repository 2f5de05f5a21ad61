"""The single-process oracles of the conformance kit: plain Hugging Face float32 in this process.

Written independently of the backends' helpers on purpose (no rlcore.training
code): the kit compares every backend with these. Heavy imports (torch,
transformers) stay inside the functions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def hf_token_logprobs(model: Any, data: Any) -> torch.Tensor:
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


def hf_logits_at_indices(model: Any, data: Any) -> torch.Tensor:
    """The ``logits_at_indices`` loss input from a plain Hugging Face forward: position ``i`` holds the logits at
    position ``i - 1`` at the ids ``data['logit_indices'][:, i]``; position 0 and padding are 0. Written
    independently of rlcore.training on purpose: it is the oracle."""
    import torch

    ids, lengths, indices = data["input_ids"], data["input_lengths"], data["logit_indices"]
    positions = torch.arange(ids.shape[1])[None, :]
    valid = positions < lengths[:, None]
    logits = model(input_ids=ids, attention_mask=valid.long(), use_cache=False).logits.float()
    picked = logits[:, :-1].gather(-1, indices[:, 1:])
    out = torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1)
    keep = valid.clone()
    keep[:, 0] = False
    return torch.where(keep[..., None], out, torch.zeros_like(out))


def hf_full_vocabulary_inputs(model: Any, data: Any) -> dict[str, torch.Tensor]:
    """The ``logprobs_at_indices`` and ``entropy`` loss inputs from a plain Hugging Face forward, recomputed in
    float64 (``log_softmax`` over the whole vocabulary at position ``i - 1``; position 0 and padding are 0), cast
    to float32 as a backend gives them. Written independently of rlcore.training on purpose: it is the oracle."""
    import torch

    ids, lengths, indices = data["input_ids"], data["input_lengths"], data["logit_indices"]
    keep = torch.arange(ids.shape[1])[None, :] < lengths[:, None]
    logits = model(input_ids=ids, attention_mask=keep.long(), use_cache=False).logits.double()
    logp = torch.log_softmax(logits[:, :-1], dim=-1)
    picked = torch.cat(
        [torch.zeros_like(logp[:, :1, :1]).expand(-1, -1, indices.shape[-1]), logp.gather(-1, indices[:, 1:])], dim=1
    )
    entropy = -(logp.exp() * logp).sum(-1)
    entropy = torch.cat([torch.zeros_like(entropy[:, :1]), entropy], dim=1)
    keep[:, 0] = False
    return {
        "logprobs_at_indices": torch.where(keep[..., None], picked, 0.0).float(),
        "entropy": torch.where(keep, entropy, 0.0).float(),
    }


def load_hf_model(path: str) -> Any:
    """``AutoModelForCausalLM.from_pretrained(path)`` in float32; fails if any weight was not in the files."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.utils.logging.disable_progress_bar()
    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    bad = {k: sorted(v) for k, v in info.items() if k != "error_msgs" and v}
    if bad or info.get("error_msgs"):
        raise AssertionError(
            f"checkpoint {path} does not load cleanly with AutoModelForCausalLM: {bad or info['error_msgs']}"
        )
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


def train_one_step_and_save(
    policy: Any, data: Any, loss_fn: Any, weights_dir: Path, optimizer_path: Path | None = None
) -> dict:
    """One optimizer step of ``policy`` on ``data``, then a checkpoint at ``weights_dir``; the train result."""
    result = policy.train(data, loss_fn)
    policy.save_checkpoint(str(weights_dir), str(optimizer_path) if optimizer_path else None)
    assert len(result["loss"]) == 1, f"one global batch gave {len(result['loss'])} optimizer steps"
    return result


def train_and_save_step(
    policy: Any, data: Any, loss_fn: Any, weights_dir: Path, optimizer_path: Path | None = None
) -> StepRecord:
    """One optimizer step of ``policy``, then a checkpoint; the record's weights are read back with HF."""
    result = train_one_step_and_save(policy, data, loss_fn, weights_dir, optimizer_path)
    return StepRecord(
        float(result["loss"][0]), float(result["grad_norm"][0]), state_copy(load_hf_model(str(weights_dir)))
    )


def oracle_gradients(model: Any, data: Any, loss_fn: Any) -> tuple[float, dict]:
    """The loss of one optimizer step over all of ``data`` and ``{parameter name: gradient}`` (one forward)."""
    model.zero_grad(set_to_none=True)
    sample_mask = data["sample_mask"].float()
    seqs = sample_mask.sum()
    toks = (data["token_mask"][:, 1:].float() * sample_mask[:, None]).sum()
    asked = tuple(getattr(loss_fn, "inputs", ()))
    if "logits_at_indices" in asked:
        data = {**data, "logits_at_indices": hf_logits_at_indices(model, data)}
    if {"logprobs_at_indices", "entropy"} & set(asked):
        data = {**data, **hf_full_vocabulary_inputs(model, data)}
    loss, _ = loss_fn(hf_token_logprobs(model, data), data, seqs, toks)
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


__all__ = [
    "StepRecord",
    "hf_full_vocabulary_inputs",
    "hf_logits_at_indices",
    "hf_token_logprobs",
    "load_hf_model",
    "oracle_gradients",
    "single_process_sgd",
    "state_copy",
    "train_and_save_step",
    "train_one_step_and_save",
]


def weight_problems(actual: dict, expected: dict, initial: dict, rtol: float, what: str = "weights") -> list[str]:
    """Problems comparing ``actual`` with ``expected`` post-step weights (empty when equal).

    The error is measured against the size of the update: a parameter fails
    when ``max|actual - expected| > rtol * max|expected - initial|`` (largest
    update of any parameter), so a wrong gradient scale shows up as an error
    of order 1 while float round-off stays near 1e-6.
    """
    problems = []
    missing, extra = sorted(set(expected) - set(actual)), sorted(set(actual) - set(expected))
    if missing:
        problems.append(f"{what}: missing parameters {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if extra:
        problems.append(f"{what}: unexpected parameters {extra[:5]}{' ...' if len(extra) > 5 else ''}")
    scale = max(float((expected[k].double() - initial[k].double()).abs().max()) for k in expected)
    if scale == 0:
        return problems + [f"{what}: the reference step changed no weight; the comparison would be vacuous"]
    errors = []
    for name in sorted(set(actual) & set(expected)):
        a, e = actual[name], expected[name]
        if tuple(a.shape) != tuple(e.shape):
            problems.append(f"{what}: {name} has shape {tuple(a.shape)}, expected {tuple(e.shape)}")
            continue
        err = float((a.double() - e.double()).abs().max()) / scale
        if not err <= rtol:
            errors.append((err, name))
    for err, name in sorted(errors, reverse=True)[:5]:
        problems.append(f"{what}: {name} differs by {err:.3g} x the largest update (> {rtol:g})")
    if len(errors) > 5:
        problems.append(f"{what}: ... and {len(errors) - 5} more parameters")
    return problems


def close(actual: float, expected: float, rtol: float) -> bool:
    """``actual`` within ``rtol`` of ``expected`` (absolute below 1)."""
    return abs(actual - expected) <= rtol * max(1.0, abs(expected))


def step_problems(
    actual: list[StepRecord],
    expected: list[StepRecord],
    initial: dict,
    where: str,
    *,
    loss_rtol: float,
    grad_norm_rtol: float,
    weight_rtol: float,
) -> list[str]:
    """How a run's optimizer steps differ from a reference run's: loss, grad norm, and each step's update.

    Each step is judged by its own update: the run's weights are compared after removing the difference both
    runs already had before the step, so a round-off carried from a large earlier step is not charged again to
    a small later one (relative to whose update it could exceed the tolerance)."""
    problems, before, before_got = [], initial, initial
    for k, (got, want) in enumerate(zip(actual, expected), start=1):
        at = f"{where}, step {k}"
        if not close(got.loss, want.loss, loss_rtol):
            problems.append(f"{at}: loss {got.loss!r} != {want.loss!r}")
        if not close(got.grad_norm, want.grad_norm, grad_norm_rtol):
            problems.append(f"{at}: grad_norm {got.grad_norm!r} != {want.grad_norm!r}")
        problems += weight_problems(
            _without_carried_drift(got.weights, before_got, before), want.weights, before, weight_rtol, at
        )
        before, before_got = want.weights, got.weights
    return problems


def _without_carried_drift(weights: dict, before_got: dict, before_expected: dict) -> dict:
    """``weights - before_got + before_expected`` per parameter present in all three with one shape (others as
    they are, so missing or extra parameters are still reported)."""
    out = {}
    for name, value in weights.items():
        a, b = before_got.get(name), before_expected.get(name)
        same = a is not None and b is not None and a.shape == b.shape == value.shape
        out[name] = value.double() - a.double() + b.double() if same else value
    return out
