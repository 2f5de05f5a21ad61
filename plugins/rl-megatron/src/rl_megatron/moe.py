"""The router aux loss of a mixture-of-experts model, as Hugging Face computes it.

megatron-core's ``aux_loss`` (``switch_load_balancing_loss_func``) is computed per layer, divided by the top-k and
summed over layers; Hugging Face's ``load_balancing_loss_func`` (Qwen3-MoE's, Mixtral's) pools the expert counts and
router probabilities of *all* layers first, then takes one product, not divided by the top-k. The two disagree, so
the megatron backend turns megatron's off and adds Hugging Face's, normalised per step as on dtensor
(:mod:`rlcore.training.moe_aux`, design.md §2.3):

    step aux loss = coeff · Σ_micro-batches (T_mb / T_step) · LB(mb)

where ``LB(mb)`` is ``load_balancing_loss`` over the micro-batch's routed tokens, ``T_mb`` their number and
``T_step`` those of the whole optimizer step across data-parallel ranks. Routed tokens are the positions before
``input_lengths`` of the rows whose ``sample_mask`` is 1 (``moe_aux.routed_tokens``). The worker hands each
micro-batch's ``AuxLoss`` to rlcore's training loop (``StepHooks.model_aux_loss``), which does the step
normalisation and reports the ``moe_aux_loss`` metric.

:class:`RouterLogits` keeps each router's logits of the current forward (megatron's routers return only the
chosen experts' probabilities): the logits megatron routed with, in its router dtype, still in the graph;
gathered over TP under sequence parallelism and over CP under context parallelism, so every rank's aux loss is
the one of the whole micro-batch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from rl_megatron.converter import ModelShape
from rl_megatron.weights import ExpertGroup
from rlcore.data import BatchedDataDict
from rlcore.training import moe_aux


class RouterLogits:
    """Collects every ``TopKRouter``'s gating logits (``[S, B, E]``) of the forward pass in flight.

    Under sequence parallelism each TP rank routes only its slice of the sequence: the recorded logits are
    all-gathered along the sequence (the whole micro-batch's, as the aux loss needs), and the gradient of that
    copy is split back, not summed, since every TP rank computes the same aux loss from it. Under context
    parallelism (``cp_group``) each CP rank routes its own positions: the logits are then all-gathered over CP as
    well, into global order, the gradient again split back (:func:`rl_megatron.context_parallel.gather_router_logits`).
    """

    def __init__(self, model: torch.nn.Module, sequence_parallel: bool = False, cp_group: Any = None) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self.logits: list[torch.Tensor] = []
        self.sequence_parallel = sequence_parallel
        self.cp_group = cp_group
        self.routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        for router in self.routers:
            router.gating = self._recording(router.gating)

    def _recording(self, gating: Any) -> Any:
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        def gating_and_record(input: torch.Tensor) -> torch.Tensor:
            logits = gating(input)
            whole = logits
            if self.sequence_parallel:
                whole = gather_from_sequence_parallel_region(logits, tensor_parallel_output_grad=False)
            if self.cp_group is not None:
                from rl_megatron.context_parallel import gather_router_logits

                whole = gather_router_logits(whole, self.cp_group)
            self.logits.append(whole)
            return logits

        return gating_and_record

    def clear(self) -> None:
        self.logits = []

    def take(self) -> list[torch.Tensor]:
        """The logits of the last forward, layer by layer (activation recomputation appends its own copies
        later: only the first ``len(routers)`` are this forward's)."""
        out, self.logits = self.logits[: len(self.routers)], []
        return out


def define_missing_te_gemm() -> None:
    """megatron-core 0.16.1's router gating reads ``moe_utils.te_general_gemm`` (``is not None``), a name it defines
    only when TransformerEngine imports: without TransformerEngine every MoE forward raises NameError. Defining it
    as None takes megatron's own PyTorch branch (``torch.mm`` in the router dtype). Does nothing where it exists."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def routed_mask(lengths: torch.Tensor, sample_mask: torch.Tensor, width: int) -> torch.Tensor:
    """``[S, B]`` bool (megatron's sequence-first layout): the routed tokens, positions inside ``input_lengths`` of
    the rows whose ``sample_mask`` is 1."""
    inside = torch.arange(width, device=lengths.device)[None, :] < lengths[:, None]
    return (inside & sample_mask.to(lengths.device).bool()[:, None]).t()


class MixtureOfExpertsStage:
    """The MoE part of ``MegatronPolicyWorker`` (a mixin): the expert-parallel group, the routers' setup and the aux
    loss of each micro-batch. Reads the worker's ``shape``, ``mcfg``, ``gpt`` and ``router_logits``."""

    shape: ModelShape
    mcfg: Any  # rl_megatron.config.MegatronConfig
    gpt: torch.nn.Module
    router_logits: RouterLogits | None

    def _expert_group(self) -> ExpertGroup:
        if not self.shape.is_moe:
            return ExpertGroup()
        from megatron.core import parallel_state as ps

        group = ps.get_expert_model_parallel_group()
        return ExpertGroup(
            rank=ps.get_expert_model_parallel_rank(),
            ranks=tuple(dist.get_process_group_ranks(group)),
            group=group,
            experts_per_rank=self.shape.num_experts // ps.get_expert_model_parallel_world_size(),
        )

    def _moe_setup(self) -> RouterLogits | None:
        """Freeze the routers (``freeze_moe_router``) and record their logits for the aux loss."""
        if not self.shape.is_moe:
            return None
        define_missing_te_gemm()
        cp_group = None
        if self.mcfg.context_parallel_size > 1:
            from megatron.core import parallel_state as ps

            cp_group = ps.get_context_parallel_group()
        logits = RouterLogits(self.gpt, sequence_parallel=self.mcfg.sequence_parallel, cp_group=cp_group)
        if self.mcfg.freeze_moe_router:
            for router in logits.routers:
                router.weight.requires_grad_(False)
        return logits

    def _aux_loss_coeff(self) -> float:
        """The weight of Hugging Face's load-balancing loss (0: none), see :mod:`rl_megatron.moe`."""
        m = self.mcfg
        if not self.shape.is_moe or m.moe_router_load_balancing_type == "none":
            return 0.0
        return self.shape.router_aux_loss_coef if m.moe_aux_loss_coeff is None else m.moe_aux_loss_coeff

    def _router_aux_loss(self, mb: BatchedDataDict) -> moe_aux.AuxLoss | None:
        """The load-balancing loss of the forward that just ran on ``mb`` (before the step normalisation, which
        rlcore's loop applies), or None when the model trains none."""
        coeff = self._aux_loss_coeff()
        if coeff == 0.0:
            return None
        router_logits = self.router_logits
        assert router_logits is not None  # a model with experts records them (_moe_setup)
        logits = router_logits.take()
        device = logits[0].device
        mask = routed_mask(mb["input_lengths"].to(device), mb["sample_mask"], logits[0].shape[0])
        experts = logits[0].shape[-1]  # [S, B, E] per layer, flattened like ``mask``
        flat = [layer.reshape(-1, experts) for layer in logits]
        value = moe_aux.load_balancing_loss(flat, mask.reshape(-1), self.shape.moe_topk)
        return moe_aux.AuxLoss(value, float(moe_aux.routed_tokens(mb)), coeff)


__all__ = ["MixtureOfExpertsStage", "RouterLogits", "define_missing_te_gemm", "routed_mask"]
