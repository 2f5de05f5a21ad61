"""The optimizer-step loop every training backend shares (design.md §2.3-2.4).

A backend supplies how to run its model (``forward``: micro-batch → ``[B, S]``
logprobs), how its gradients are reduced across data-parallel ranks, and its
optimizer; this module supplies the semantics that must be identical across
backends: global batches → optimizer steps, micro-batches, loss normalised by
the valid-token / valid-sequence counts of the whole step across dp, summed
losses and gradients, ``max_grad_norm: None`` = no clipping, and a step whose
loss or gradient norm is NaN or +-inf skipped: no parameter update, the
optimizer and scheduler untouched, the gradients dropped (``skipped``; the
worker stops the run after ``policy.max_consecutive_skipped_steps`` in a row).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from itertools import accumulate
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from rlcore.data import BatchedDataDict
    from rlcore.interfaces import LossFunction
    from rlcore.training.moe_aux import AuxLoss


@dataclass
class StepHooks:
    """What a backend plugs into :func:`train_steps`.

    - ``forward(mb)``: ``[B, S]`` float32 logprobs of the micro-batch (grad-enabled).
    - ``all_reduce_sum(t)``: sums a tensor over the dp group, in place. ``t`` is a small CPU tensor
      (step counters, the step loss); a backend on NCCL moves it to its device and back.
    - ``finish_grads()``: makes every rank hold the dp-SUM of gradients (e.g. an
      all-reduce; FSDP does it during backward and then only needs rescaling).
    - ``clip_grads(max_norm)``: returns the total grad norm, clipping when
      ``max_norm`` is not None.
    - ``optimizer_step()``: optimizer and scheduler step, then zero the grads.
    - ``zero_grad()``: drop gradients (used in eval mode).
    - ``run_micro_batches(mbs, loss_of, eval_mode)`` (optional): run a step's micro-batches
      yourself, calling ``loss_of(mb, logprobs)`` for each and back-propagating the loss it returns
      unless ``eval_mode`` — for an engine that schedules them together (megatron's pipeline). By
      default each micro-batch runs ``forward`` then ``backward``. When the loss asks for inputs
      beyond logprobs, ``loss_of.inputs`` names them and each must be in ``mb`` before the call.
    - ``before_micro_batch(last)`` (optional): called before each micro-batch of a training (not eval)
      step, ``last`` true for the step's final one; where a backend tells its engine which backward
      reduces and reshards (FSDP2), keeping the loop itself the core's.
    - ``forward_with_inputs(mb, names)`` (optional, capability ``logits_at_indices``): one forward
      giving the logprobs and ``{name: tensor}`` of the loss inputs ``names``
      (:mod:`rlcore.training.loss_inputs`); used instead of ``forward`` when the loss asks for them.
    - ``model_aux_loss()`` (optional): the model's own auxiliary loss of the forward that just ran
      (:class:`rlcore.training.moe_aux.AuxLoss`, a mixture-of-experts' load balancing), or None; the loop adds it
      to that micro-batch's loss normalised by the step's routed tokens over every dp rank
      (:mod:`rlcore.training.moe_aux`) and reports it as the ``moe_aux_loss`` metric.
    - ``all_agree(ok)`` (optional): whether ``ok`` holds on every rank that trains the model. By default the
      step's loss, summed over dp, is the same on every rank and so is the decision to skip a step; a
      backend whose ranks see different losses (megatron: only the last pipeline stage computes it) reduces
      the flag over all of them, or the ranks would diverge.

    A step is skipped (``zero_grad`` instead of ``optimizer_step``) when its loss is not finite, without
    calling ``clip_grads``, or when the norm ``clip_grads`` returns is not finite: a backend whose
    ``clip_grads`` also steps (megatron) must not step then.
    """

    forward: Callable[[BatchedDataDict[Any]], torch.Tensor]
    all_reduce_sum: Callable[[torch.Tensor], None]
    finish_grads: Callable[[], None]
    clip_grads: Callable[[float | None], float]
    optimizer_step: Callable[[], None]
    zero_grad: Callable[[], None]
    run_micro_batches: Callable[[list[BatchedDataDict[Any]], Callable[..., torch.Tensor], bool], None] | None = None
    forward_with_inputs: (
        Callable[[BatchedDataDict[Any], tuple[str, ...]], tuple[torch.Tensor, dict[str, torch.Tensor]]] | None
    ) = None
    all_agree: Callable[[bool], bool] | None = None
    before_micro_batch: Callable[[bool], None] | None = None
    model_aux_loss: Callable[[], AuxLoss | None] | None = None

    def run(
        self,
        mbs: Iterable[BatchedDataDict[Any]],
        loss_of: Callable[..., torch.Tensor],
        eval_mode: bool,
        inputs: tuple[str, ...] = (),
    ) -> None:
        """Forward (and backward unless ``eval_mode``) every micro-batch of one step; ``inputs``: what the
        loss needs in each micro-batch beyond the logprobs."""
        if self.run_micro_batches is not None:
            loss_of.inputs = inputs  # type: ignore[attr-defined]
            self.run_micro_batches(list(mbs), loss_of, eval_mode)
            return
        if inputs and self.forward_with_inputs is None:
            raise ValueError(
                f"the loss asks for {', '.join(inputs)}, which this backend's step hooks do not "
                "compute (no forward_with_inputs; capability 'logits_at_indices')"
            )
        mbs = list(mbs)
        for i, mb in enumerate(mbs):
            if not eval_mode and self.before_micro_batch is not None:
                self.before_micro_batch(i == len(mbs) - 1)
            if inputs:
                logprobs, extra = self.forward_with_inputs(mb, inputs)
                mb.update(extra)
            else:
                logprobs = self.forward(mb)
            loss = loss_of(mb, logprobs)
            if not eval_mode:
                loss.backward()


def valid_counts(batch: BatchedDataDict[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Local (valid sequences, valid tokens): tokens are ``token_mask * sample_mask`` at positions 1..S-1."""
    import torch

    sample_mask = batch["sample_mask"].float()
    token_mask = batch["token_mask"][:, 1:].float() * sample_mask[:, None]
    return sample_mask.sum().to(torch.float64), token_mask.sum().to(torch.float64)


def pad_to_multiple(mb: BatchedDataDict[Any], multiple: int) -> BatchedDataDict[Any]:
    """Right-pad ``mb``'s sequence tensors (dim 1 = ``input_ids``' width) with zeros to a multiple of
    ``multiple`` (``policy.make_sequence_length_divisible_by``). Padding has token_mask 0 and lies past
    ``input_lengths``, so nothing computed for the real tokens changes."""
    width = mb._seq_width()
    if multiple <= 1 or width is None or width % multiple == 0:
        return mb
    return mb._fit_seq_dim(width, -(-width // multiple) * multiple)


def cut_to_longest(mb: BatchedDataDict[Any]) -> BatchedDataDict[Any]:
    """Cut ``mb``'s sequence tensors to its own longest ``input_lengths``.

    A rollout is padded to its longest completion; a micro-batch of shorter ones would otherwise
    run its forward and backward over that padding. Only padding past every row's length goes, so
    nothing computed for the real tokens changes (the models are causal)."""
    width = mb._seq_width()
    if width is None or "input_lengths" not in mb or mb.size == 0:
        return mb
    return mb._fit_seq_dim(width, max(1, int(mb["input_lengths"].max())))


def micro_batches(step: BatchedDataDict[Any], mbs: int, mode: str, multiple: int = 1) -> Iterator[BatchedDataDict[Any]]:
    if mode == "dynamic":
        batches = step.make_microbatch_iterator_with_dynamic_shapes()
    elif mode == "packing":
        batches = step.make_microbatch_iterator_for_packable_sequences()
    else:
        batches = (cut_to_longest(mb) for mb in step.make_microbatch_iterator(mbs))
    return (pad_to_multiple(mb, multiple) for mb in batches)


def train_steps(
    shard: BatchedDataDict[Any],
    loss_fn: LossFunction,
    hooks: StepHooks,
    *,
    local_batch_size: int,
    mbs: int,
    max_grad_norm: float | None,
    eval_mode: bool = False,
    mode: str = "plain",
    seq_multiple: int = 1,
) -> dict[str, Any]:
    """Run every optimizer step in this rank's ``shard``.

    ``local_batch_size`` is this rank's share of one global batch (gbs // dp);
    in dynamic/packing mode the step boundaries come from the shard's metadata.
    Every micro-batch is padded to a multiple of ``seq_multiple`` (:func:`pad_to_multiple`).
    Returns per-step global losses, grad norms and whether the step was ``skipped`` for a non-finite loss or
    grad norm (its grad norm is NaN when the loss already was), and per-micro-batch metrics
    (each metric is the micro-batch's contribution to the global value, see
    :mod:`rlcore.algorithms.loss_functions`; summing a step's micro-batches over
    all dp ranks gives the step's global value).
    """
    import torch

    from rlcore.training import moe_aux
    from rlcore.training.loss_inputs import loss_inputs

    inputs = loss_inputs(loss_fn)
    num_steps = shard.num_steps if mode != "plain" else shard.size // local_batch_size
    losses, grad_norms, skipped = [], [], []
    mb_metrics: dict[str, list[float]] = defaultdict(list)
    for k in range(num_steps):
        step = shard.get_batch(k, None if mode != "plain" else local_batch_size)
        with_aux = hooks.model_aux_loss is not None
        counts = torch.stack([*valid_counts(step), *([moe_aux.routed_tokens(step)] if with_aux else [])])
        hooks.all_reduce_sum(counts)
        global_seqs, global_toks = counts[0].float(), counts[1].float()
        global_routed = float(counts[2]) if with_aux else 0.0
        step_sum: torch.Tensor | None = None  # the step loss, summed on the loss's device: read once per step
        step_metrics: dict[str, list[Any]] = defaultdict(list)

        def loss_of(mb: BatchedDataDict[Any], logprobs: torch.Tensor) -> torch.Tensor:
            nonlocal step_sum
            loss, metrics = loss_fn(logprobs, mb, global_seqs, global_toks)
            aux = hooks.model_aux_loss() if hooks.model_aux_loss is not None else None
            if aux is not None:
                share = aux.value * (aux.tokens / global_routed) if global_routed else aux.value * 0.0
                loss = loss + aux.coef * share
                metrics = {**metrics, moe_aux.METRIC: share.detach()}
            step_sum = loss.detach().double() if step_sum is None else step_sum + loss.detach().double()
            for name, value in metrics.items():
                step_metrics[name].append(value)
            return loss

        with torch.set_grad_enabled(not eval_mode):
            hooks.run(micro_batches(step, mbs, mode, seq_multiple), loss_of, eval_mode, inputs)
        step_loss = step_sum.cpu() if step_sum is not None else torch.zeros((), dtype=torch.float64)
        for name, values in zip(
            step_metrics,
            host_values([v for vs in step_metrics.values() for v in vs], [len(vs) for vs in step_metrics.values()]),
        ):
            mb_metrics[name].extend(values)
        hooks.all_reduce_sum(step_loss)
        if eval_mode:
            hooks.zero_grad()
            grad_norms.append(0.0)
            skipped.append(False)
        else:
            hooks.finish_grads()
            loss_ok = math.isfinite(float(step_loss))
            if hooks.all_agree is not None:
                loss_ok = hooks.all_agree(loss_ok)
            grad_norms.append(float(hooks.clip_grads(max_grad_norm)) if loss_ok else float("nan"))
            skipped.append(not (loss_ok and math.isfinite(grad_norms[-1])))
            if skipped[-1]:  # a NaN step would make every weight NaN: the weights and optimizer stay as they were
                hooks.zero_grad()
            else:
                hooks.optimizer_step()
        losses.append(float(step_loss))
    return {"losses": losses, "grad_norms": grad_norms, "skipped": skipped, "all_mb_metrics": dict(mb_metrics)}


def host_values(values: list[Any], lengths: list[int]) -> list[list[float]]:
    """A step's metric values as Python floats, in runs of ``lengths``: numbers as they are, tensors (a loss may
    return 0-dim tensors, left on its device) read to the host in one copy for the whole step rather than one
    device sync per micro-batch."""
    import torch

    groups: dict[tuple[Any, Any], list[int]] = defaultdict(list)  # one stack and one cast per dtype, not per value
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor):
            groups[v.dtype, v.device].append(i)
    read: dict[int, float] = {}
    if groups:
        stacked = [torch.stack([values[i].detach().reshape(()) for i in idx]).double() for idx in groups.values()]
        flat = torch.cat([t.to(stacked[0].device) for t in stacked]).cpu().tolist()
        read = dict(zip([i for idx in groups.values() for i in idx], flat))
    floats = [read[i] if i in read else float(v) for i, v in enumerate(values)]
    runs = [0, *accumulate(lengths)]
    return [floats[a:b] for a, b in zip(runs, runs[1:])]
