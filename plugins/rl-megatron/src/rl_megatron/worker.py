"""``MegatronPolicyWorker``: one rank of the megatron-core training backend.

Each rank holds one (pipeline stage, TP shard) of a megatron-core ``GPTModel``
built from the Hugging Face config and loaded from HF weights through
:mod:`rl_megatron.converter`. Ranks are laid out as rlcore's
``NamedSharding`` says, (pp, dp, cp, tp) with tp fastest, which is
megatron's default order ``tp-cp-ep-dp-pp``; the worker checks that the two
agree.

Training and logprob passes go through megatron's pipeline schedules (:mod:`rl_megatron.pipeline`)
(``get_forward_backward_func``), so every stage runs the same micro-batches in
lockstep; the last stage computes logprobs from vocabulary-parallel logits and
the loss. The semantics are rlcore's (design.md §2.3-2.4, as in
``rlcore.training.loop``): ``N / gbs`` optimizer steps, the loss normalised by
the step's global valid token/sequence counts across dp, losses and gradients
*summed* over micro-batches and dp ranks. Megatron is told so by
``calculate_per_token_loss=True`` (no division by the number of micro-batches,
no 1/dp gradient scaling in DDP) and by a ``finalize_model_grads_func`` that
all-reduces gradients without rescaling them by a token count.

Results live on the last pipeline stage; ``Policy`` reads from pipeline rank 0,
so every result is broadcast over the pipeline group before it is returned.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from rl_megatron import vocab_parallel
from rl_megatron.config import megatron_config_problems, megatron_section
from rl_megatron.converter import ModelShape
from rl_megatron.model import build_gpt_model, transformer_config
from rl_megatron.moe import MixtureOfExpertsStage
from rl_megatron.pipeline import PipelineStages
from rl_megatron.value_worker import MegatronValueModel
from rl_megatron.weights import HFExporter, stage_layer_offsets
from rl_megatron.worker_checkpoints import MegatronCheckpoints
from rlcore.data import BatchedDataDict
from rlcore.refit import RefitExportMixin
from rlcore.training import moe_aux
from rlcore.training.checkpoint_files import check_inside
from rlcore.training.logprobs import align
from rlcore.training.loop import StepHooks
from rlcore.training.process_group import init_distributed
from rlcore.training.value_head import ModelHead
from rlcore.training.worker_base import TrainingWorkerBase

#: Seed of megatron's RNG tracker (dropout is zero in these models; the seed only fixes the streams).
SEED = 1234


def _transformer_engine_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None


class MegatronPolicyWorker(
    PipelineStages,
    MixtureOfExpertsStage,
    MegatronCheckpoints,
    MegatronValueModel,
    RefitExportMixin,
    TrainingWorkerBase,
):
    """One rank of the ``megatron`` backend (see the module docstring).

    Refit: :meth:`prepare_refit_info` and :meth:`iter_refit_tensors` are the export;
    ``RefitExportMixin`` turns them into the shared-memory and collective transports.
    With ``model_head='value'`` it is a value model (:mod:`rl_megatron.value_worker`): ``get_values`` instead of
    the token-distribution methods, no reference model.
    """

    def __init__(
        self,
        config: Any,
        tokenizer: Any = None,
        *,
        weights_path: str | None = None,
        optimizer_path: str | None = None,
        init_optimizer: bool = True,
        init_reference_model: bool = True,
        backend_config: Any = None,
        layout: Any = None,
        model_head: ModelHead = "lm",
    ) -> None:
        # backend_config is policy.megatron_cfg (rl_megatron.config.MegatronConfig), layout its tp/cp/pp;
        # model_head (rlcore 0.3) "lm" (a causal LM) or "value" (a value model: rl_megatron.value_worker).
        from rl_megatron.wandb_guard import keep_wandb_out

        keep_wandb_out()  # before megatron-core's first import (rl_megatron.wandb_guard says why)
        from rlcore.config import as_policy_config
        from rlcore.config.errors import ConfigError
        from rlcore.training.hf_config import load_config
        from rlcore.training.value_head import check_model_head, value_model_config

        self.model_head = check_model_head(model_head)
        config = as_policy_config(config)  # the seed's plain dict is accepted too
        mcfg = megatron_section(config, backend_config)
        cuda = torch.cuda.is_available()
        problems = megatron_config_problems(config, mcfg, cuda=cuda, transformer_engine=_transformer_engine_available())
        if problems:
            raise ConfigError(problems)
        self.cfg, self.mcfg, self.tokenizer = config, mcfg, tokenizer
        self.device = init_distributed()
        if not cuda:
            from rl_megatron import cpu_compat

            cpu_compat.apply()
        self._init_parallel_state()

        for checkpoint in filter(None, (weights_path, optimizer_path)):
            check_inside(checkpoint)  # a checkpoint reads its own files only
        hf_path = weights_path or config.model_name
        self.hf_config = load_config(hf_path, config.hf_config_overrides)  # policy.hf_config_overrides applied
        if self.is_value_model:  # saved as AutoModelForTokenClassification with one label
            self.hf_config = value_model_config(self.hf_config)
        self.shape = ModelShape.from_hf_config(self.hf_config, self.mcfg.converter_type, self.is_value_model)
        self.shape.check_tp(self.tp_size)
        self.shape.check_ep(self.mcfg.expert_model_parallel_size)
        self.experts = self._expert_group()
        self.tconfig = transformer_config(self.shape, self.hf_config, self.mcfg, config.precision, use_cpu=not cuda)
        # Micro-batches are cut to their own longest sequence, so shapes vary between them.
        self.tconfig.variable_seq_lengths = self.pp_size > 1
        self.stage_offsets = stage_layer_offsets(self.tconfig, self.pp_size)
        self.gpt = build_gpt_model(self.shape, self.tconfig, self.hf_config, self.first_stage, self.last_stage)
        if cuda:
            self.gpt.cuda(self.device)
        self.router_logits = self._moe_setup()
        self._load_hf(hf_path)
        self.vocab_start = self.tp_rank * (self.shape.padded_vocab_size(self.tp_size) // self.tp_size)

        self.optimizer = self.scheduler = None
        self.model: torch.nn.Module = self.gpt
        if init_optimizer:
            self._init_ddp_and_optimizer()
        self._exporter: HFExporter | None = None
        if optimizer_path:
            self._load_megatron_checkpoint(optimizer_path)
        if init_reference_model:  # a value model has none (TrainingWorkerBase.init_reference_model ignores it)
            self.init_reference_model()

    # -- setup -----------------------------------------------------------------------
    def _init_parallel_state(self) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        from rlcore.distributed import NamedSharding

        m = self.mcfg
        tp, pp, cp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            context_parallel_size=cp,
            expert_model_parallel_size=m.expert_model_parallel_size,
            expert_tensor_parallel_size=m.expert_tensor_parallel_size,
            order="tp-cp-ep-dp-pp",
        )
        model_parallel_cuda_manual_seed(SEED)
        self.rank = dist.get_rank()
        self.tp_size, self.pp_size = tp, pp
        self.tp_rank, self.pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        self.dp_size, self.dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        self.tp_group, self.pp_group = ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group()
        self.dp_group = ps.get_data_parallel_group()
        self.cp_group = ps.get_context_parallel_group() if cp > 1 else None  # rl_megatron.context_parallel
        self.pp_ranks = dist.get_process_group_ranks(self.pp_group)
        self.first_stage, self.last_stage = self.pp_rank == 0, self.pp_rank == pp - 1
        ours = NamedSharding.for_world(dist.get_world_size(), tp=tp, cp=cp, pp=pp).coords(self.rank)
        theirs = {"pp": self.pp_rank, "dp": self.dp_rank, "cp": ps.get_context_parallel_rank(), "tp": self.tp_rank}
        if ours != theirs:
            raise RuntimeError(f"rank {self.rank}: megatron placed it at {theirs}, rlcore's layout says {ours}")

    def _init_ddp_and_optimizer(self) -> None:
        from rl_megatron import optimizer

        fused_adam = self.device.type == "cuda" and _transformer_engine_available()
        built = optimizer.build(self.gpt, self.tconfig, self.mcfg, self.cfg, fused_adam=fused_adam)
        self.model, self.optimizer, self.scheduler = built.model, built.optimizer, built.scheduler

    def _token_logprobs(self, mb: BatchedDataDict, logits: torch.Tensor) -> torch.Tensor:
        """``[B, S]`` aligned float32 logprobs (differentiable) at the caller's width."""
        logits = logits[:, : mb["input_ids"].shape[1]]  # drop make_sequence_length_divisible_by padding
        ids = mb["input_ids"][:, : logits.shape[1]].to(logits.device)
        # rollouts were sampled from softmax(logits / T)
        next_lp = vocab_parallel.token_logprobs(
            logits,
            ids,
            self.vocab_start,
            self.shape.vocab_size,
            self.tp_group,
            self.logprob_temperature,
            self.cfg.logprob_chunk_size,
        )
        lp = align(next_lp, mb["input_lengths"])
        return torch.nn.functional.pad(lp, (0, mb["input_ids"].shape[1] - lp.shape[1]))

    def _loss_inputs(self, mb: BatchedDataDict, logits: torch.Tensor, names: tuple[str, ...]) -> dict:
        """The loss inputs ``names`` (:mod:`rlcore.training.loss_inputs`) at the caller's width, from this rank's
        vocabulary slice (padded vocabulary rows carry no probability)."""
        from rlcore.training.loss_inputs import compute_loss_inputs

        width = mb["input_ids"].shape[1]
        logits = vocab_parallel.mask_padded_vocab(logits[:, :width], self.vocab_start, self.shape.vocab_size)
        values = compute_loss_inputs(logits, mb, names, self.vocab_start, self.tp_group)
        return {
            name: torch.nn.functional.pad(v, (0, 0) * (v.ndim - 2) + (0, width - v.shape[1]))
            for name, v in values.items()
        }

    def _empty_cache(self, level: int) -> None:
        if self.mcfg.empty_unused_memory_level >= level and self.device.type == "cuda":
            torch.cuda.empty_cache()

    @staticmethod
    def _check_mode(mode: str) -> None:
        if mode != "plain":
            raise ValueError(f"the megatron backend supports plain micro-batching only, got mode {mode!r}")

    # -- inference -----------------------------------------------------------------------
    def _token_pass(
        self,
        data: BatchedDataDict,
        micro_batch_size: int | None,
        per_token: Callable[[BatchedDataDict, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """``[B, S]`` float32 ``per_token(mb, model output)`` of every micro-batch, on CPU, on every stage."""
        parts: list[torch.Tensor] = []
        mbs = list(data.make_microbatch_iterator(micro_batch_size or self.cfg.logprob_batch_size))
        self.model.eval()
        with torch.no_grad():
            self._run_schedule(mbs, lambda mb, out: parts.append(per_token(mb, out)), True)
        self._empty_cache(1)
        shape = tuple(data["input_ids"].shape)
        out = torch.cat(parts).float() if self.last_stage else None
        return self._tensor_from_last_stage(out, shape, torch.float32).cpu()

    def get_logprobs(
        self, data: BatchedDataDict, micro_batch_size: int | None = None, mode: str = "plain"
    ) -> BatchedDataDict:
        self._refuse_on_value_model("get_logprobs")
        self._check_mode(mode)
        return BatchedDataDict(logprobs=self._token_pass(data, micro_batch_size, self._token_logprobs))

    def get_reference_policy_logprobs(
        self, data: BatchedDataDict, micro_batch_size: int | None = None, mode: str = "plain"
    ) -> BatchedDataDict:
        self._refuse_on_value_model("get_reference_policy_logprobs")
        return super().get_reference_policy_logprobs(data, micro_batch_size, mode)

    def get_topk_logits(
        self, data: BatchedDataDict, k: int, micro_batch_size: int | None = None, mode: str = "plain"
    ) -> BatchedDataDict:
        self._refuse_on_value_model("get_topk_logits")
        self._check_mode(mode)
        width = data["input_ids"].shape[1] - 1
        values: list[torch.Tensor] = []
        indices: list[torch.Tensor] = []

        def collect(mb: BatchedDataDict, logits: torch.Tensor) -> None:
            v, i = vocab_parallel.topk(logits, k, self.vocab_start, self.shape.vocab_size, self.tp_group)
            v, i = v[:, :width], i[:, :width]  # padded widths (make_sequence_length_divisible_by) cut back
            pad = (0, 0, 0, width - v.shape[1])
            values.append(torch.nn.functional.pad(v, pad))
            indices.append(torch.nn.functional.pad(i, pad))

        self.model.eval()
        with torch.no_grad():
            self._run_schedule(
                list(data.make_microbatch_iterator(micro_batch_size or self.cfg.logprob_batch_size)), collect, True
            )
        shape = (data.size, width, k)
        v = self._tensor_from_last_stage(torch.cat(values) if self.last_stage else None, shape, torch.float32)
        i = self._tensor_from_last_stage(torch.cat(indices) if self.last_stage else None, shape, torch.int64)
        return BatchedDataDict(topk_logits=v.cpu(), topk_indices=i.cpu())

    # -- training ---------------------------------------------------------------------------
    def train(
        self,
        data: BatchedDataDict,
        loss_fn: Any,
        eval_mode: bool = False,
        gbs: int | None = None,
        mbs: int | None = None,
        mode: str = "plain",
    ) -> dict[str, Any]:
        """``rlcore.training.loop.train_steps`` with :meth:`_step_hooks`; losses and metrics come from the
        last pipeline stage."""
        self._check_mode(mode)
        if not eval_mode:
            self._zero_grads()  # restored (GPU-offloaded) gradient buffers hold no zeros yet
        result = super().train(data, loss_fn, eval_mode, gbs, mbs, mode)
        result["losses"], result["all_mb_metrics"] = self._from_last_stage((result["losses"], result["all_mb_metrics"]))
        return result

    def _step_hooks(self) -> StepHooks:
        """Micro-batches run through megatron's pipeline schedule (which back-propagates and, through
        ``finalize_model_grads``, sums gradients over dp). megatron's optimizer clips inside its own step
        (``clip_grad`` = policy.max_grad_norm), so the clip hook is the step and returns the norm."""

        pending_aux: list[moe_aux.AuxLoss | None] = [None]  # the router aux loss of the forward that just ran

        def run_micro_batches(mbs: list[BatchedDataDict], loss_of: Callable, eval_mode: bool) -> None:
            inputs = tuple(getattr(loss_of, "inputs", ()))  # none on a value model (value_step_hooks refuses them)

            def on_logits(mb: BatchedDataDict, logits: torch.Tensor) -> torch.Tensor:
                pending_aux[0] = self._router_aux_loss(mb)  # loss_of adds it, normalised over the step
                if self.is_value_model:  # the head's output: the loss gets values where it gets logprobs
                    return loss_of(mb, self._values_of(mb, logits))
                mb.update(self._loss_inputs(mb, logits, inputs))
                return loss_of(mb, self._token_logprobs(mb, logits))

            self._run_schedule(mbs, on_logits, forward_only=eval_mode)
            self._empty_cache(1)

        def take_aux() -> moe_aux.AuxLoss | None:
            aux, pending_aux[0] = pending_aux[0], None
            return aux

        def unused_forward(mb: BatchedDataDict) -> torch.Tensor:
            raise AssertionError("megatron runs micro-batches through run_micro_batches")

        return StepHooks(
            forward=unused_forward,
            all_reduce_sum=lambda t: self._all_reduce_sum(t, self.dp_group),
            finish_grads=lambda: None,
            clip_grads=lambda max_norm: self._optimizer_step(),
            optimizer_step=self._zero_grads,
            zero_grad=self._zero_grads,
            run_micro_batches=run_micro_batches,
            all_agree=self._all_agree,  # only the last pipeline stage computes the loss
            model_aux_loss=take_aux if self._aux_loss_coeff() else None,
        )

    def _all_agree(self, ok: bool) -> bool:
        """Whether ``ok`` holds on every rank (all pipeline stages, tp and dp ranks)."""
        flag = torch.tensor([0.0 if ok else 1.0])
        self._all_reduce_sum(flag)
        return float(flag) == 0.0

    def _optimizer_step(self) -> float:
        """Clip (policy.max_grad_norm) and step; returns the global gradient norm before clipping.

        megatron-core steps on NaN gradients unless an fp16 loss scaler finds them, so the norm (global over
        every rank, the same on each) is checked first: a non-finite one is returned without a step, the
        scheduler untouched, and the shared loop drops the gradients. Its check costs one more pass over the
        gradients (``prepare_grads`` copies them to the main grads again in ``step``: a copy, not a sum)."""
        checked = None
        if not self.optimizer.config.fp16:  # with fp16, megatron's loss scaler checks them and skips the step
            self.optimizer.prepare_grads()
            checked = float(self.optimizer.get_grad_norm())
            if not math.isfinite(checked):
                return checked
        success, grad_norm, _ = self.optimizer.step()
        if not success:  # the fp16 loss scaler found inf/NaN gradients and skipped the update
            return float("nan")
        if grad_norm is None or self.cfg.max_grad_norm is None:  # the norm before clipping
            grad_norm = checked if checked is not None else self.optimizer.get_grad_norm()
        self.scheduler.step(increment=1)
        return float(grad_norm)

    def _zero_grads(self) -> None:
        if self.optimizer is not None:
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
        self._empty_cache(2)

    # -- reference model (this rank's own shards, kept on CPU) ---------------------------------
    def _snapshot_to_cpu(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().to("cpu", copy=True) for name, p in self.gpt.named_parameters()}

    @torch.no_grad()
    def _load_snapshot(self, state: dict[str, torch.Tensor]) -> None:
        for name, p in self.gpt.named_parameters():
            p.copy_(state[name])

    # -- refit export ---------------------------------------------------------------------------
    @property
    def exporter(self) -> HFExporter:
        if self._exporter is None:
            self._exporter = HFExporter(
                self.shape,
                self.gpt,
                self.stage_offsets,
                self.pp_rank,
                self.tp_group,
                self.tp_size,
                self.pp_group,
                self.pp_ranks,
                self.experts,
            )
        return self._exporter

    def prepare_refit_info(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """``{hf_name: (shape, dtype)}`` in the order :meth:`iter_refit_tensors` yields them."""
        self._refuse_on_value_model("prepare_refit_info")
        return self.exporter.refit_info()

    def iter_refit_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, full HF tensor)`` for the whole model. Collective: every rank must iterate it."""
        self._refuse_on_value_model("refit")
        return iter(self.exporter)

    def init_collective(self, ip: str, port: int, world_size: int, *, train_world_size: int = 1) -> None:
        self._refuse_on_value_model("init_collective")
        super().init_collective(ip, port, world_size, train_world_size=train_world_size)

    # -- memory hooks -----------------------------------------------------------------------------
    def _optimizer_state_to(self, device: torch.device | str) -> None:
        if self.optimizer is None:
            return
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            for state in opt.optimizer.state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor):
                        state[key] = value.to(device)

    def offload_before_refit(self) -> None:
        """On a GPU, move the optimizer state to CPU while the weights are exported."""
        if self.device.type == "cuda":
            self._optimizer_state_to("cpu")
            torch.cuda.empty_cache()

    def offload_after_refit(self) -> None:
        """On a GPU, also release the gradient buffers until training resumes."""
        if self.device.type == "cuda" and self.optimizer is not None:
            self.model.offload_grad_buffers()

    def prepare_for_training(self, *args: Any, **kwargs: Any) -> None:
        if self.device.type == "cuda" and self.optimizer is not None:
            self.model.restore_grad_buffers()
            self._optimizer_state_to(self.device)
        self.model.train()

    # -- test helpers ----------------------------------------------------------------------------
    def hf_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The full HF state dict on global rank 0 (None elsewhere). Collective."""
        out = {name: t.cpu().clone() for name, t in self.exporter}
        return out if self.rank == 0 else None

    def wandb_imported(self) -> bool:
        from rl_megatron.wandb_guard import wandb_imported

        return wandb_imported()

    def optimizer_state_summary(self) -> dict[str, Any]:
        from rl_megatron import optimizer

        return optimizer.state_summary(self.optimizer)

    def redirected_call_sites(self) -> list[tuple[str, str]] | None:
        """The megatron call sites ``cpu_compat`` redirected in this process; None where it is not active."""
        from rl_megatron import cpu_compat

        return cpu_compat.observed_call_sites() if cpu_compat.is_applied() else None

    def shutdown(self) -> None:
        from megatron.core import parallel_state as ps

        with contextlib.suppress(Exception):
            ps.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


__all__ = ["MegatronPolicyWorker"]
