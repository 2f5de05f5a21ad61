"""``TrainingWorkerBase``: what every training backend's Ray worker shares.

A backend subclass builds its (possibly sharded) model in ``__init__``, ends
it with :meth:`_init_optimizer_and_reference` (or builds its own optimizer), and
provides:

- :meth:`_forward_logprobs` (micro-batch → ``[B, S]`` float32 logprobs, grad-enabled) and
  :meth:`_forward_topk` (micro-batch → top-k logits of next-token positions), unless its model is a
  whole Hugging Face causal LM, which the defaults run;
- :meth:`_step_hooks` (how gradients are reduced, clipped and applied);
- for a value model (capability ``value_head``: its ``__init__`` takes ``model_head`` and sets
  ``self.model_head``), :meth:`_forward_values` (micro-batch → ``[B, S]`` values in the logprob alignment,
  :mod:`rlcore.training.value_head`), unless its model is a whole Hugging Face token-classification model.

The base class turns those into the worker methods the ``Policy`` calls, with
the contracts of design.md §2: alignment, padding back to the caller's width,
the shared optimizer-step loop, and the reference model swapped in from a CPU
copy of this rank's own shards.

Training randomness (dropout, LoRA dropout, anything that draws from torch's
generator during ``train``) is a pure function of the optimizer steps taken
and the rank (:func:`training_random_state`): a resumed run, whose scheduler
state says how many steps were taken, draws what the uninterrupted run drew.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

from rlcore.data import BatchedDataDict
from rlcore.training.checkpoint import is_adapter_checkpoint
from rlcore.training.logprobs import token_logprobs, topk_logits
from rlcore.training.loop import StepHooks, micro_batches, train_steps
from rlcore.training.lora import adapters_disabled, changed_layers
from rlcore.training.optim import build_optimizer, build_scheduler
from rlcore.training.value_head import ModelHead, aligned_values, no_token_distribution, value_step_hooks
from rlcore.training.vision import VisionForward


class NonFiniteStepsError(RuntimeError):
    """Too many optimizer steps in a row had a NaN or infinite loss or gradient norm."""


def optimizer_steps_taken(scheduler: Any) -> int | None:
    """How many optimizer steps ``scheduler`` has seen (torch's ``last_epoch``, megatron's ``num_steps``), None
    for a scheduler that does not say; it is checkpointed with the optimizer, so a resumed run reads it too."""
    for name in ("last_epoch", "num_steps"):
        value = getattr(scheduler, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


@contextlib.contextmanager
def training_random_state(steps_taken: int | None, rank: int, device: torch.device) -> Iterator[None]:
    """Inside the block torch's generators (CPU, and ``device``'s when it is an accelerator) are seeded from
    ``steps_taken`` and ``rank`` alone; after it they are as they were. None: nothing is seeded (a scheduler
    that does not count its steps: the run's randomness is then that of the process, not reproduced on resume)."""
    if steps_taken is None:
        yield
        return
    accelerator = device.type not in ("cpu", "meta")
    devices = [device.index if device.index is not None else 0] if accelerator else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if accelerator else "cuda"):
        torch.manual_seed(1_000_003 * steps_taken + rank)  # every device's generator, from the step and rank
        yield


def initial_weights_dir(model_name: str) -> str:
    """The directory of ``policy.model_name``'s weights: the path itself, or the hub model's snapshot in the local
    cache (the run loaded it from there when it started)."""
    if os.path.isdir(model_name):
        return model_name
    from huggingface_hub import snapshot_download

    return snapshot_download(model_name, local_files_only=True)


#: ``policy.precision`` → torch dtype.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TrainingWorkerBase:
    """Shared worker surface; subclasses set ``self.cfg``, ``self.model``, ``self.device``, ``self.dp_size``."""

    cfg: Any
    model: torch.nn.Module
    device: torch.device
    dp_size: int
    reference_state: dict[str, torch.Tensor] | None = None
    lora_targets: list[str] = []  # paths of the LoRA-adapted layers (set in __init__ when policy.lora is on)
    consecutive_skipped: int = 0  # optimizer steps skipped in a row for a non-finite loss or gradient norm
    model_head: ModelHead = "lm"  # "value": a value model (set in __init__ from the model_head keyword)
    vision: VisionForward | None = None  # a vision-language model's image inputs (set in __init__)

    def optimized_parameter_names(self) -> list[str]:
        """Names of the parameters the optimizer steps (tests check what a frozen vision tower leaves out)."""
        stepped = {id(p) for group in self.optimizer.param_groups for p in group["params"]}
        return [name for name, p in self.model.named_parameters() if id(p) in stepped]

    # -- to implement (the forwards default to a whole Hugging Face causal LM in self.model) ---------
    def _logits(self, mb: BatchedDataDict) -> torch.Tensor:
        """``[B, S, V]`` logits of a micro-batch from ``self.model`` called as a Hugging Face causal LM."""
        ids = mb["input_ids"].to(self.device)
        kwargs: dict[str, Any] = {
            "input_ids": ids,
            "attention_mask": attention_mask(mb, self.device),
            "use_cache": False,
        }
        if self.vision is not None:  # a vision-language model: the rows' images (rlcore.training.vision)
            kwargs.update(self.vision.kwargs(ids, mb))
        return self.model(**kwargs).logits

    def _forward_logprobs(self, mb: BatchedDataDict) -> torch.Tensor:
        return self._logprobs_of(self._logits(mb), mb)

    def _logprobs_of(self, logits: torch.Tensor, mb: BatchedDataDict) -> torch.Tensor:
        return token_logprobs(
            logits,
            mb["input_ids"].to(self.device),
            mb["input_lengths"],
            temperature=self.logprob_temperature,
            chunk_size=self.cfg.logprob_chunk_size,
        )

    def _forward_topk(self, mb: BatchedDataDict, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return topk_logits(self._logits(mb), k)

    def _forward_with_inputs(self, mb: BatchedDataDict, names: tuple[str, ...]) -> tuple[torch.Tensor, dict]:
        """One forward: the logprobs and the loss inputs ``names`` (:mod:`rlcore.training.loss_inputs`)."""
        from rlcore.training.loss_inputs import compute_loss_inputs

        logits = self._logits(mb)
        return self._logprobs_of(logits, mb), compute_loss_inputs(logits, mb, names)

    def _step_hooks(self) -> StepHooks:
        raise NotImplementedError

    def _forward_values(self, mb: BatchedDataDict) -> torch.Tensor:
        """``[B, S]`` float32 values of a micro-batch (value model), from ``self.model`` called as a Hugging Face
        ``AutoModelForTokenClassification`` with one label; grad-enabled."""
        ids = mb["input_ids"].to(self.device)
        head = self.model(input_ids=ids, attention_mask=attention_mask(mb, self.device), use_cache=False).logits
        return aligned_values(head, mb["input_lengths"].to(self.device))

    @property
    def logprob_temperature(self) -> float:
        """The generation temperature, applied to the policy's logits too.

        Rollouts are sampled from softmax(logits / T); the ratios and KL of the
        loss compare against that distribution, so the training side divides its
        logits by the same T (1.0 without generation, or for greedy T = 0).
        """
        gen = getattr(self.cfg, "generation", None)
        return gen.temperature if gen is not None and gen.temperature > 0 else 1.0

    # -- set-up --------------------------------------------------------------------
    def _init_optimizer_and_reference(
        self,
        params: Any,
        *,
        init_optimizer: bool,
        optimizer_path: str | None,
        init_reference_model: bool,
        load_optimizer: Callable[[str], None],
    ) -> None:
        """The end of a backend's ``__init__``: the optimizer and scheduler of ``policy.optimizer`` /
        ``policy.scheduler`` over ``params`` (none for an inference-only policy), their state restored by
        ``load_optimizer(optimizer_path)`` when resuming, then the reference copy of the weights."""
        self.optimizer = build_optimizer(params, self.cfg.optimizer, self.cfg.learning_rate) if init_optimizer else None
        self.scheduler = build_scheduler(self.optimizer, self.cfg.scheduler) if self.optimizer else None
        if optimizer_path and self.optimizer is not None:
            load_optimizer(optimizer_path)
        if init_reference_model and self.model_head == "lm":  # a value model has no reference (rlcore 0.3)
            self.init_reference_model()

    # -- reference model ---------------------------------------------------------
    def _snapshot_to_cpu(self) -> dict[str, torch.Tensor]:
        """A CPU copy of this rank's parameters and buffers (its own shards only).

        The default reads ``model.state_dict()``: right for replicated models and for FSDP2 /
        DTensor (whose state dict holds local shards). A wrapper whose state dict is a collective
        full gather (FSDP1) must override this and :meth:`_load_snapshot`, and drop any cached
        gathered parameters before writing shards back.
        """
        return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    def _load_snapshot(self, state: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(state)

    def __new__(cls, *args: Any, **kwargs: Any) -> TrainingWorkerBase:
        # Noted before the backend's __init__ runs: a worker resumed from a checkpoint (``weights_path``, as the
        # Policy passes it) takes its reference from the initial weights, not from the checkpoint's.
        worker = super().__new__(cls)
        worker._resumed_weights = kwargs.get("weights_path")
        return worker

    def init_reference_model(self) -> None:
        """A CPU copy of this rank's shards of the initial weights (``policy.model_name``, also when the worker
        resumed from a checkpoint: the reference of DPO and of a KL penalty never moves); none with LoRA, whose
        reference is the model with adapters off; none for a value model."""
        if self.lora_targets or self.model_head == "value":
            return
        resumed = getattr(self, "_resumed_weights", None)
        if not resumed or is_adapter_checkpoint(resumed):  # an adapter checkpoint's base weights are the initial ones
            self.reference_state = self._snapshot_to_cpu()
            return
        trained = self._snapshot_to_cpu()
        self.load_checkpoint(initial_weights_dir(self.cfg.model_name))
        self.reference_state = self._snapshot_to_cpu()
        self._load_snapshot(trained)

    @contextlib.contextmanager
    def use_reference_model(self) -> Iterator[None]:
        """Swap the reference weights in from their CPU copy (LoRA: switch the adapters off); undo after."""
        if self.lora_targets:
            with adapters_disabled(self.model):
                yield
            return
        if self.reference_state is None:
            raise RuntimeError("this worker was created with init_reference_model=False")
        trained = self._snapshot_to_cpu()
        self._load_snapshot(self.reference_state)
        try:
            yield
        finally:
            self._load_snapshot(trained)

    # -- LoRA --------------------------------------------------------------------
    def _changed_layers(self, changed_only: bool) -> set[str] | None:
        """With LoRA, a refit after the first sends only the adapted layers (the rest never changes)."""
        return changed_layers(self.lora_targets) if changed_only and self.lora_targets else None

    # -- inference passes ----------------------------------------------------------
    def _map_micro_batches(
        self, data: BatchedDataDict, fn: Callable[[BatchedDataDict], dict], micro_batch_size: int | None, mode: str
    ) -> BatchedDataDict:
        self.model.eval()
        mbs = micro_batch_size or self.cfg.logprob_batch_size
        with torch.no_grad():
            multiple = self.cfg.make_sequence_length_divisible_by
            parts = [fn(mb) for mb in micro_batches(data, mbs, mode, multiple)]
        return BatchedDataDict.from_batches(parts)

    def _refuse_on_value_model(self, method: str) -> None:
        """Logprobs, top-k, generation and refit need a token distribution, which a value model has not."""
        if self.model_head == "value":
            raise no_token_distribution(method)

    def get_values(
        self, data: BatchedDataDict, micro_batch_size: int | None = None, mode: str = "plain"
    ) -> BatchedDataDict:
        """``values`` ``[B, S]`` float32 of a value model (capability ``value_head``), aligned like logprobs."""
        if self.model_head != "value":
            raise RuntimeError("get_values: this worker is a language model; build it with model_head='value'")
        out = self._map_micro_batches(
            data, lambda mb: {"values": self._forward_values(mb).float().cpu()}, micro_batch_size, mode
        )
        return pad_dim1(out, "values", data["input_ids"].shape[1])

    def get_logprobs(
        self, data: BatchedDataDict, micro_batch_size: int | None = None, mode: str = "plain"
    ) -> BatchedDataDict:
        self._refuse_on_value_model("get_logprobs")
        out = self._map_micro_batches(
            data, lambda mb: {"logprobs": self._forward_logprobs(mb).cpu()}, micro_batch_size, mode
        )
        return pad_dim1(out, "logprobs", data["input_ids"].shape[1])

    def get_reference_policy_logprobs(
        self, data: BatchedDataDict, micro_batch_size: int | None = None, mode: str = "plain"
    ) -> BatchedDataDict:
        self._refuse_on_value_model("get_reference_policy_logprobs")
        with self.use_reference_model():
            out = self.get_logprobs(data, micro_batch_size, mode)
        return BatchedDataDict(reference_logprobs=out["logprobs"])

    def get_topk_logits(
        self, data: BatchedDataDict, k: int, micro_batch_size: int | None = None, mode: str = "plain"
    ) -> BatchedDataDict:
        self._refuse_on_value_model("get_topk_logits")

        def run(mb: BatchedDataDict) -> dict:
            values, indices = self._forward_topk(mb, k)
            return {"topk_logits": values.cpu(), "topk_indices": indices.cpu()}

        out = self._map_micro_batches(data, run, micro_batch_size, mode)
        width = data["input_ids"].shape[1] - 1
        return pad_dim1(pad_dim1(out, "topk_logits", width), "topk_indices", width)

    # -- building blocks of _step_hooks ---------------------------------------------
    def _all_reduce_sum(self, t: torch.Tensor, group: Any = None) -> None:
        """Sum ``t`` over ``group`` (default: all ranks) in place, through this rank's device.

        The loop's counters live on CPU; NCCL only reduces device tensors.
        """
        import torch.distributed as dist

        on_device = t.to(self.device)
        dist.all_reduce(on_device, op=dist.ReduceOp.SUM, group=group)
        if on_device is not t:
            t.copy_(on_device)

    def _optimizer_step(self) -> None:
        """Optimizer step, scheduler step, then drop the gradients."""
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    # -- training ------------------------------------------------------------------
    def train(
        self,
        data: BatchedDataDict,
        loss_fn: Any,
        eval_mode: bool = False,
        gbs: int | None = None,
        mbs: int | None = None,
        mode: str = "plain",
    ) -> dict[str, Any]:
        if getattr(self, "optimizer", None) is None and not eval_mode:
            raise RuntimeError("this worker was created with init_optimizer=False; it cannot train")
        gbs = gbs or self.cfg.train_global_batch_size
        mbs = mbs or self.cfg.train_micro_batch_size
        self.model.train(not eval_mode)
        steps = optimizer_steps_taken(getattr(self, "scheduler", None))
        with training_random_state(steps, int(os.environ.get("RANK", "0")), self.device):
            result = train_steps(
                data,
                loss_fn,
                self._loss_step_hooks(loss_fn),
                local_batch_size=gbs // self.dp_size,
                mbs=mbs,
                max_grad_norm=self.cfg.max_grad_norm,
                eval_mode=eval_mode,
                mode=mode,
                seq_multiple=self.cfg.make_sequence_length_divisible_by,
            )
        self._count_skipped(result)
        return result

    def _loss_step_hooks(self, loss_fn: Any) -> StepHooks:
        """The backend's step hooks; a value model's forward feeds the loss its values instead of logprobs."""
        hooks = self._step_hooks()
        if self.model_head != "value":
            return hooks
        from rlcore.training.loss_inputs import loss_inputs

        return value_step_hooks(hooks, self._forward_values, loss_inputs(loss_fn))

    def _count_skipped(self, result: dict[str, Any]) -> None:
        """Stop after ``policy.max_consecutive_skipped_steps`` optimizer steps in a row skipped for a non-finite
        loss or gradient norm (every rank takes the same decisions, so every rank stops)."""
        limit = getattr(self.cfg, "max_consecutive_skipped_steps", None)
        for skipped, loss, norm in zip(result["skipped"], result["losses"], result["grad_norms"]):
            self.consecutive_skipped = self.consecutive_skipped + 1 if skipped else 0
            if limit is not None and self.consecutive_skipped >= limit:
                raise NonFiniteStepsError(
                    f"{self.consecutive_skipped} optimizer steps in a row were skipped, the last with loss {loss} and "
                    f"gradient norm {norm} (policy.max_consecutive_skipped_steps={limit}); the weights are those "
                    "before the first of them. Check the rewards and the data, or lower the learning rate"
                )

    # -- lifecycle and introspection (override where a backend moves memory) ---------
    def prepare_for_training(self, *args: Any, **kwargs: Any) -> None:
        self.model.train()

    def prepare_for_lp_inference(self) -> None:
        self.model.eval()

    def finish_training(self, *args: Any, **kwargs: Any) -> None:
        pass

    def offload_before_refit(self) -> None:
        pass

    def offload_after_refit(self) -> None:
        pass

    def is_alive(self) -> bool:
        return True

    def report_device_id(self) -> str:
        return str(self.device)

    def get_gpu_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {"rank": int(os.environ.get("RANK", 0)), "device": str(self.device), "pid": os.getpid()}
        if self.device.type == "cuda":
            info["memory_allocated_mb"] = torch.cuda.memory_allocated(self.device) / 2**20
            info["peak_memory_allocated_mb"] = torch.cuda.max_memory_allocated(self.device) / 2**20
        return info

    def reset_peak_memory_stats(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def start_gpu_profiling(self) -> None:
        """Start a torch profiler trace (written to $RLCORE_PROFILE_DIR on stop)."""
        self._profiler = torch.profiler.profile(record_shapes=False)
        self._profiler.__enter__()

    def stop_gpu_profiling(self) -> None:
        profiler = getattr(self, "_profiler", None)
        if profiler is None:
            return
        profiler.__exit__(None, None, None)
        out_dir = os.environ.get("RLCORE_PROFILE_DIR")
        if out_dir:
            os.makedirs(out_dir, exist_ok=True)
            profiler.export_chrome_trace(os.path.join(out_dir, f"trace_rank{os.environ.get('RANK', 0)}.json"))
        self._profiler = None

    def shutdown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def attention_mask(mb: BatchedDataDict, device: torch.device) -> torch.Tensor:
    """``[B, S]`` 1 on each row's first ``input_lengths`` positions (right padding), 0 after."""
    positions = torch.arange(mb["input_ids"].shape[1], device=device)
    return (positions[None, :] < mb["input_lengths"].to(device)[:, None]).long()


def pad_dim1(data: BatchedDataDict, key: str, width: int) -> BatchedDataDict:
    """Fit ``data[key]`` to ``width`` along dim 1: zero-pad (micro-batches may be narrower) or cut
    (dynamic batching may round a micro-batch's length past the caller's width)."""
    t = data[key]
    if t.shape[1] > width:
        data[key] = t[:, :width].contiguous()
    elif t.shape[1] < width:
        pad = torch.zeros(t.shape[0], width - t.shape[1], *t.shape[2:], dtype=t.dtype)
        data[key] = torch.cat([t, pad], dim=1)
    return data
