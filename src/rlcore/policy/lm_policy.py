"""``Policy``: the driver-side facade over a training backend's workers (seed 001).

It takes a resolved policy (:func:`rlcore.config.resolve_policy`; a plain
config is resolved here, once), starts one worker per rank with the keyword
arguments its constructor declares, shards data over the data-parallel ranks
of the layout the backend declared (plain, dynamic batching or sequence
packing, as the batch plan says), and puts results back in the caller's order.
It calls the workers through the Protocols of :mod:`rlcore.interfaces.workers`
and never imports the backend's modules.
"""

from __future__ import annotations

import os
from typing import Any, Literal, Union

from rlcore.config import ConfigError, ResolvedPolicy, batch_problems, resolve_policy
from rlcore.data import BatchedDataDict
from rlcore.distributed import (
    NamedSharding,
    RayVirtualCluster,
    RayWorkerGroup,
    WorkerGroupOwner,
)
from rlcore.interfaces import ColocatablePolicyInterface, GenerationInterface
from rlcore.interfaces.loss import LOSS_INPUTS, loss_inputs, step_metrics
from rlcore.interfaces.workers import (
    GeneratingWorker,
    LoraWorker,
    RefitWorker,
    TopkLogitsWorker,
    TrainingWorker,
    ValueWorker,
)
from rlcore.plugins import BackendError, Capability
from rlcore.preflight import check_policy_sources

PathLike = Union[str, "os.PathLike[str]"]


def resolved_policy(config: Any, cluster: RayVirtualCluster) -> ResolvedPolicy:
    """``config`` (a ``ResolvedPolicy``, a ``PolicyConfig`` or the seed's plain dict) resolved for ``cluster``.

    A plain dict that is NeMo-RL's own policy section gets a hint on how to convert it.
    """
    if isinstance(config, ResolvedPolicy):
        return config
    try:
        return resolve_policy(config, world_size=cluster.world_size, use_gpu=bool(cluster.use_gpus))
    except ConfigError as exc:
        from rlcore.nemo_rl import nemo_rl_policy_hint

        raise ConfigError(exc.problems + nemo_rl_policy_hint(exc.problems)) from None


def value_head_problem(spec_name: str, capabilities: frozenset[Capability], model_head: str) -> str | None:
    """Why a ``Policy`` of ``model_head`` cannot run on the backend ``spec_name`` (None when it can)."""
    if model_head not in ("lm", "value"):
        return f"model_head={model_head!r}: expected 'lm' (a language model) or 'value' (a value model)"
    if model_head == "value" and Capability.VALUE_HEAD not in capabilities:
        return (
            f"model_head='value': the '{spec_name}' training backend does not declare 'value_head', so it cannot "
            "build a value model; give the value model a backend that declares it (dtensor, megatron; "
            "`rlcore backends list` shows each backend's capabilities)"
        )
    return None


class Policy(WorkerGroupOwner, ColocatablePolicyInterface, GenerationInterface):
    """The driver's handle on a training backend's workers.

    ``model_head="value"`` makes it a value model (capability ``value_head``, rlcore 0.3): the language model's
    trunk with a scalar head (Hugging Face's ``AutoModelForTokenClassification`` with one label). It answers
    :meth:`get_values` and trains with a loss that gets values where a language model's gets logprobs; it has no
    token distribution (logprobs, top-k, generation and refit are refused) and no reference model
    (``init_reference_model`` is ignored).
    """

    def __init__(
        self,
        cluster: RayVirtualCluster,
        config: Any,
        tokenizer: Any,
        name_prefix: str = "lm_policy",
        workers_per_node: int | list[int] | None = None,
        init_optimizer: bool = True,
        weights_path: PathLike | None = None,
        optimizer_path: PathLike | None = None,
        init_reference_model: bool = True,
        model_head: Literal["lm", "value"] = "lm",
    ) -> None:
        self.resolved = resolved_policy(config, cluster)
        self.cfg = self.resolved.config
        self.spec = self.resolved.spec
        self.tokenizer = tokenizer
        if problem := value_head_problem(self.spec.name, self.spec.capabilities, model_head):
            raise BackendError(problem)  # before any worker starts
        self._model_head = model_head
        if problems := check_policy_sources(self.cfg, weights_path, optimizer_path):
            raise ConfigError(problems)  # a missing or damaged model fails here, before any worker starts
        if workers_per_node is not None:
            wanted = (
                sum(workers_per_node)
                if isinstance(workers_per_node, list)
                else workers_per_node * len(cluster.bundle_ct_per_node_list)
            )
            if wanted != cluster.world_size:
                raise ValueError(
                    f"workers_per_node={workers_per_node} gives {wanted} workers but the cluster "
                    f"has {cluster.world_size} bundles"
                )
        self.sharding = NamedSharding.for_world(cluster.world_size, **self.resolved.layout.sizes())
        available = dict(
            weights_path=str(weights_path) if weights_path else None,
            optimizer_path=str(optimizer_path) if optimizer_path else None,
            init_optimizer=init_optimizer,
            init_reference_model=init_reference_model,
            backend_config=self.resolved.section,
            layout=self.resolved.layout,
        )
        if model_head != "lm":  # offered only when it asks for more than every worker built before 0.3 builds:
            # a worker taking **kwargs and passing them to a parent that predates model_head keeps working
            available["model_head"] = model_head
        self.worker_group = RayWorkerGroup(
            cluster,
            self.spec.worker_class,
            sharding=self.sharding,
            name_prefix=f"{name_prefix}-{self.spec.name}",
            init_args=(self.cfg, tokenizer),
            offered_kwargs=available,  # the worker gets those its constructor declares
            capabilities=tuple(self.spec.capabilities),  # a missing method of one is refused in the worker
            extra_env=dict(self.cfg.env_vars),  # policy.env_vars: set in each rank before its worker is built
        )
        # Constructing actors is asynchronous: wait so that a worker that cannot start fails here.
        self._all(TrainingWorker.is_alive)

    # -- dispatch helpers ----------------------------------------------------------
    def _sharded(
        self, method: Any, data: BatchedDataDict, purpose: str, batch_size: int | None = None, **kwargs: Any
    ) -> tuple[list[Any], list[int] | None]:
        self._check_length(method.__name__, data)
        plan = self.resolved.batch
        dp = self.sharding.dp
        size = data.size
        if batch_size is None and size % dp:
            raise ValueError(
                f"{method.__name__}: batch of {size} samples cannot be split over dp={dp} ranks; "
                "pad it to a multiple of the data-parallel size"
            )
        sharded = data.shard_by_batch_size(dp, batch_size=batch_size, **plan.shard_args(purpose))
        shards, order = (sharded, None) if plan.mode == "plain" else sharded
        wg = self.worker_group
        results = wg.get_results(wg.run_all_workers_sharded_data(method, shards, mode=plan.mode, **kwargs))
        return results, order

    def _check_length(self, method: str, data: BatchedDataDict) -> None:
        limit = self.cfg.max_total_sequence_length
        longest = int(data["input_lengths"].max()) if "input_lengths" in data and data.size else 0
        if longest > limit:
            raise ValueError(
                f"{method}: a sequence of {longest} tokens is longer than "
                f"policy.max_total_sequence_length={limit}; raise it or shorten the batch"
            )

    # -- value models ------------------------------------------------------------------
    @property
    def model_head(self) -> Literal["lm", "value"]:
        """``"lm"`` (a language model) or ``"value"`` (a value model), as constructed."""
        return self._model_head

    def get_values(self, data: BatchedDataDict, micro_batch_size: int | None = None) -> BatchedDataDict:
        """``values`` ``[B, S]`` float32 of a value model, rows in ``data``'s order: position ``i`` holds V(s_i),
        the value of the state in which token ``i`` is chosen; position 0 and padding are 0."""
        if self._model_head != "value":
            raise BackendError("get_values: this Policy is a language model; construct it with model_head='value'")
        results, order = self._sharded(ValueWorker.get_values, data, "logprob", micro_batch_size=micro_batch_size)
        return BatchedDataDict.from_shards(results, order)

    def _refuse_on_value_model(self, method: str) -> None:
        if self._model_head == "value":
            from rlcore.training.value_head import no_token_distribution

            raise no_token_distribution(method)

    # -- PolicyInterface -------------------------------------------------------------
    def get_logprobs(self, data: BatchedDataDict) -> BatchedDataDict:
        self._refuse_on_value_model("get_logprobs")
        results, order = self._sharded(TrainingWorker.get_logprobs, data, "logprob")
        return BatchedDataDict.from_shards(results, order)

    def get_reference_policy_logprobs(
        self, data: BatchedDataDict, micro_batch_size: int | None = None
    ) -> BatchedDataDict:
        self._refuse_on_value_model("get_reference_policy_logprobs")
        results, order = self._sharded(
            TrainingWorker.get_reference_policy_logprobs, data, "logprob", micro_batch_size=micro_batch_size
        )
        return BatchedDataDict.from_shards(results, order)

    def get_topk_logits(self, data: BatchedDataDict, k: int, micro_batch_size: int | None = None) -> BatchedDataDict:
        self._refuse_on_value_model("get_topk_logits")
        self._require(Capability.TOPK_LOGITS)
        results, order = self._sharded(
            TopkLogitsWorker.get_topk_logits, data, "logprob", k=k, micro_batch_size=micro_batch_size
        )
        return BatchedDataDict.from_shards(results, order)

    def train(
        self,
        data: BatchedDataDict,
        loss_fn: Any,
        eval_mode: bool = False,
        *,
        gbs: int | None = None,
        mbs: int | None = None,
    ) -> dict[str, Any]:
        """Train on ``data``: ``len(data) // gbs`` optimizer steps.

        Returns ``loss`` and ``grad_norm`` (one value per optimizer step, global
        across ranks), ``skipped_steps`` (how many of them were skipped for a NaN or
        infinite loss or grad norm), ``metrics`` (each loss metric's global value, averaged
        over steps) and ``all_mb_metrics`` (every micro-batch's contribution, all
        ranks). Rows in groups (``data.group_size``, e.g. DPO's pairs) stay
        together: a micro-batch holds whole groups, so ``mbs`` is rounded up to a
        multiple of the group size.
        """
        import torch

        if self._model_head == "value" and loss_inputs(loss_fn):
            self._refuse_on_value_model(
                f"train with {type(loss_fn).__name__} (it asks for {', '.join(loss_inputs(loss_fn))})"
            )
        for name in loss_inputs(loss_fn):
            if not self.spec.supports(LOSS_INPUTS[name]):
                raise BackendError(
                    f"{type(loss_fn).__name__} asks for {name}, which the '{self.spec.name}' "
                    f"training backend does not compute (capability '{LOSS_INPUTS[name]}'); use "
                    "a backend that declares it"
                )
        plan = self.resolved.batch
        gbs = gbs or plan.global_batch_size
        mbs = mbs or plan.micro_batch_size
        group = data.group_size
        mbs = -(-mbs // group) * group
        if data.size % gbs:
            raise ValueError(f"train: {data.size} samples is not a whole number of global batches of {gbs}")
        if problems := batch_problems(
            gbs, mbs, plan.data_parallel_size, plan.mode, gbs_name="train: gbs", mbs_name="mbs"
        ):
            raise ValueError("; ".join(problems))
        results, _ = self._sharded(
            TrainingWorker.train, data, "train", batch_size=gbs, loss_fn=loss_fn, eval_mode=eval_mode, gbs=gbs, mbs=mbs
        )
        steps = len(results[0]["losses"])
        all_mb: dict[str, list[float]] = {}
        for r in results:
            for name, values in r["all_mb_metrics"].items():
                all_mb.setdefault(name, []).extend(values)
        return {
            "loss": torch.tensor(results[0]["losses"]),
            "grad_norm": torch.tensor(results[0]["grad_norms"]),
            "skipped_steps": sum(results[0].get("skipped", ())),  # non-finite loss or grad norm: no update
            "metrics": step_metrics(all_mb, steps),
            "all_mb_metrics": all_mb,
        }

    def generate(self, data: BatchedDataDict, greedy: bool = False) -> BatchedDataDict:
        self._refuse_on_value_model("generate")
        if not self.spec.supports(Capability.GENERATE):
            raise BackendError(f"backend '{self.spec.name}' cannot generate; use a generation backend")
        self._check_length("generate", data)
        dp = self.sharding.dp
        if data.size % dp:
            raise ValueError(
                f"generate: batch of {data.size} prompts cannot be split over dp={dp} ranks; "
                "pad it to a multiple of the data-parallel size"
            )
        shards = data.shard_by_batch_size(dp)
        wg = self.worker_group
        results = wg.get_results(wg.run_all_workers_sharded_data(GeneratingWorker.generate, shards, greedy=greedy))
        pad_id = getattr(self.tokenizer, "pad_token_id", None) or 0
        return BatchedDataDict.from_batches(results, pad_value_dict={"output_ids": pad_id})

    # -- lifecycle -------------------------------------------------------------------
    def prepare_for_generation(self, *args: Any, **kwargs: Any) -> bool:
        self._all(TrainingWorker.prepare_for_lp_inference)
        return True

    def prepare_for_training(self, *args: Any, **kwargs: Any) -> None:
        self._all(TrainingWorker.prepare_for_training)

    def prepare_for_lp_inference(self, *args: Any, **kwargs: Any) -> None:
        self._all(TrainingWorker.prepare_for_lp_inference)

    def finish_generation(self, *args: Any, **kwargs: Any) -> bool:
        return True

    def finish_training(self, *args: Any, **kwargs: Any) -> None:
        self._all(TrainingWorker.finish_training)

    def offload_before_refit(self) -> None:
        self._all(TrainingWorker.offload_before_refit)

    def offload_after_refit(self) -> None:
        self._all(TrainingWorker.offload_after_refit)

    # -- refit surface (backends that declare 'refit') ---------------------------------
    def _require(self, capability: Capability) -> None:
        if capability in (Capability.REFIT, Capability.LORA):
            self._refuse_on_value_model(f"refit ({capability})")
        if not self.spec.supports(capability):
            raise BackendError(f"backend '{self.spec.name}' does not declare '{capability}'")

    def prepare_refit_info(self, changed_only: bool = False) -> dict[str, Any] | None:
        """``{hf_name: (shape, dtype)}`` of a refit; with ``changed_only`` (LoRA) of the refits after the first."""
        self._require(Capability.REFIT)
        if changed_only:
            return self._all(LoraWorker.prepare_refit_info, changed_only=True)[0]
        return self._all(RefitWorker.prepare_refit_info)[0]

    @property
    def refits_changed_only(self) -> bool:
        """Whether refits after the first can send only what training changes (LoRA: the adapted layers)."""
        return bool(self.cfg.lora.enabled) and self.spec.supports(Capability.LORA)

    def save_lora_adapter(self, path: str) -> None:
        """Write the current adapters as a PEFT adapter directory at ``path`` (rank 0 writes; atomic).

        What an adapter refit hands the engines (``policy.lora.refit: adapter``); a
        checkpoint's ``weights/`` is the same format plus, optionally, ``merged/``.
        """
        if not self.cfg.lora.enabled:
            raise RuntimeError("save_lora_adapter: policy.lora.enabled is false, there are no adapters")
        self._all(LoraWorker.save_lora_adapter, str(path))

    def stream_weights_via_ipc_zmq(
        self, *, endpoints: dict[int, tuple[str, bytes]], bucket_bytes: int, **lora: Any
    ) -> list[Any]:
        """Every rank streams its weights to the colocated engine ``endpoints`` names; ``lora``:
        ``changed_only=True`` for a LoRA refit after the first."""
        self._require(Capability.REFIT)
        method = LoraWorker.stream_weights_via_ipc_zmq if lora else RefitWorker.stream_weights_via_ipc_zmq
        return self.worker_group.run_all_workers_single_data(
            method, endpoints=endpoints, bucket_bytes=bucket_bytes, **lora
        ).refs

    def init_collective(self, ip: str, port: int, world_size: int, *, train_world_size: int) -> list[Any]:
        self._require(Capability.REFIT)
        return self.worker_group.run_all_workers_single_data(
            RefitWorker.init_collective, ip, port, world_size, train_world_size=train_world_size
        ).refs

    def broadcast_weights_for_collective(
        self, kv_scales: dict[str, float] | None = None, *, bucket_bytes: int, **lora: Any
    ) -> list[Any]:
        """Training rank 0 broadcasts the weights to the refit group; ``lora`` as for
        :meth:`stream_weights_via_ipc_zmq`."""
        self._require(Capability.REFIT)
        method = LoraWorker.broadcast_weights_for_collective if lora else RefitWorker.broadcast_weights_for_collective
        return self.worker_group.run_all_workers_single_data(
            method, kv_scales=kv_scales, bucket_bytes=bucket_bytes, **lora
        ).refs

    # -- the older refit names (seeds 001/003/004), as adapters over the surface above -----
    def prepare_info_for_collective(self) -> dict[str, Any]:
        """Old name of :meth:`prepare_refit_info` (``{hf_name: (shape, dtype)}``)."""
        return self.prepare_refit_info() or {}

    def prepare_weights_for_ipc(self, _refit_buffer_size_gb: float | None = None) -> list[list[str]]:
        """Old IPC refit, step 1: the weight names in refit order, grouped as the refit buckets them for
        buffers of ``_refit_buffer_size_gb`` (default 1 GiB)."""
        from rlcore.refit import plan_buckets

        budget = int((_refit_buffer_size_gb or 1) * 2**30)
        return [list(bucket.names) for bucket in plan_buckets(self.prepare_refit_info(), budget)]

    def get_weights_ipc_handles(self, keys: list[str]) -> dict[str, Any]:
        """Old IPC refit, step 2. rlcore moves weights by streaming packed buffers instead of handing out
        per-tensor IPC handles: use :meth:`stream_weights_via_ipc_zmq` (or ``rlcore.refit.WeightSynchronizer``,
        which drives it and the engine's side)."""
        raise NotImplementedError(
            "get_weights_ipc_handles: rlcore streams weights instead of handing out IPC "
            "handles; use stream_weights_via_ipc_zmq or rlcore.refit.WeightSynchronizer"
        )

    # -- checkpoints, profiling, shutdown ------------------------------------------------
    def save_checkpoint(
        self, weights_path: str, optimizer_path: str | None = None, tokenizer_path: str | None = None
    ) -> None:
        self._all(
            TrainingWorker.save_checkpoint,
            str(weights_path),
            str(optimizer_path) if optimizer_path else None,
            str(tokenizer_path) if tokenizer_path else None,
        )

    def start_gpu_profiling(self) -> None:
        self._all(TrainingWorker.start_gpu_profiling)

    def stop_gpu_profiling(self) -> None:
        self._all(TrainingWorker.stop_gpu_profiling)
