"""``VllmGeneration``: the driver-side ``GenerationInterface`` over vLLM engine actors.

One Ray actor per engine rank, started by a :class:`rlcore.distributed.RayWorkerGroup`
in the bundles of a :class:`rlcore.distributed.RayVirtualCluster`:

- colocated with training: pass the training cluster, built with
  ``max_colocated_worker_groups=2``; every bundle then hosts one training
  worker and one engine, each asking for half of it;
- on its own resources: pass a cluster made for generation
  (``policy.generation.colocated.resources``).

The engines are data parallel: a batch is cut into contiguous chunks, one per
engine, and the results are concatenated back in the caller's order. This
module imports no torch and no vLLM; the engines are built inside the actors.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from rl_vllm.config import VllmConfig, vllm_config_from
from rl_vllm.engine_env import PRIVATE_IPC_ENV
from rl_vllm.group_streams import GroupStream, StreamedGroup, collect_streamed
from rl_vllm.multimodal import image_batch_problems
from rl_vllm.refit import EngineStaleError
from rl_vllm.sampling import batch_problems, sampling_options
from rlcore.data import BatchedDataDict
from rlcore.distributed import Calls, NamedSharding, RayVirtualCluster, RayWorkerGroup, WorkerGroupOwner
from rlcore.interfaces import GenerationInterface
from rlcore.interfaces.generation import PAUSE_MODES, PauseMode
from rlcore.refit import RefitError

if TYPE_CHECKING:
    from rlcore.interfaces.specs import GenerationDatumSpec

WORKER_CLASS = "rl_vllm.worker:VllmGenerationWorker"
#: Keys of a generation batch the engines read (``sampling_seeds``: a seed per request, design.md §2.1; ``images``:
#: each row's PIL images, docs/vision.md, which the engine's own processor turns into pixels).
INPUT_KEYS = ("input_ids", "input_lengths", "stop_strings", "sampling_seeds", "images")
#: Actor threads of an ``async_engine`` engine: calls waiting on their requests each hold one, and a pause,
#: resume or refit must still find one free.
ASYNC_ENGINE_CONCURRENCY = 64


#: Files of a Hugging Face tokenizer; a directory with none of them holds no tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def engine_tokenizer(vllm_cfg: VllmConfig, model: str | None, tokenizer: Any) -> str | None:
    """The tokenizer the engines load: ``vllm_cfg.tokenizer`` when set; else the model's, unless the model is a
    local directory without one (an rlcore checkpoint's ``weights/``), where the run's own tokenizer directory is
    taken (``policy.tokenizer.name``, the driver's ``tokenizer.name_or_path``) instead of an engine failing to
    start."""
    if vllm_cfg.tokenizer is not None or not model or not os.path.isdir(model):
        return vllm_cfg.tokenizer
    if any(os.path.exists(os.path.join(model, name)) for name in TOKENIZER_FILES):
        return None
    own = getattr(tokenizer, "name_or_path", None)
    return os.path.abspath(own) if isinstance(own, str) and os.path.isdir(own) else None


class VllmGeneration(WorkerGroupOwner, GenerationInterface):
    """Data-parallel vLLM engines behind ``GenerationInterface``.

    ``config`` is the ``policy.generation`` section (``GenerationConfig``):
    its sampling fields are read at every ``generate`` call (so a changed
    ``config`` applies to the next call). ``backend_config`` is its validated
    ``vllm_cfg`` sub-section, as rlcore passes it (plugin API 2); built from
    Python without it, the sub-section is validated here. Engine start-up
    failures surface from the constructor as a
    :class:`rlcore.distributed.WorkerError` naming the rank and the cause.
    """

    def __init__(
        self,
        cluster: RayVirtualCluster,
        config: Any,
        *,
        backend_config: VllmConfig | None = None,
        tokenizer: Any = None,
        name_prefix: str = "vllm",
        lora_rank: int | None = None,
        hf_config_overrides: dict[str, Any] | None = None,
    ) -> None:
        # ``tokenizer`` is part of rlcore's driver-class contract; the engines load their own (engine_tokenizer).
        # ``hf_config_overrides`` is policy.hf_config_overrides: the engines build the trainer's model config.
        self.cfg = config
        self.vllm_cfg = backend_config if backend_config is not None else vllm_config_from(config)
        found = engine_tokenizer(self.vllm_cfg, getattr(config, "model_name", None), tokenizer)
        if found != self.vllm_cfg.tokenizer:
            self.vllm_cfg = self.vllm_cfg.model_copy(update={"tokenizer": found})
        tp = self.vllm_cfg.tensor_parallel_size
        if cluster.world_size % tp:
            raise ValueError(
                f"policy.generation.vllm_cfg.tensor_parallel_size={tp} does not divide the "
                f"{cluster.world_size} bundles of the generation cluster"
            )
        engines = cluster.world_size // tp
        wanted = self.vllm_cfg.num_engines
        if wanted is not None and wanted != engines:
            raise ValueError(
                f"policy.generation.vllm_cfg.num_engines={wanted}, but the generation cluster has "
                f"{cluster.world_size} bundles, i.e. {engines} engine(s) of tensor_parallel_size={tp}"
            )
        self.sharding = NamedSharding(dp=engines, tp=tp)
        extra_env: dict[str, str] = {PRIVATE_IPC_ENV: "1"}  # a dead rank's sockets are removed by its restart
        if self.vllm_cfg.cpu_threads and not cluster.use_gpus:
            threads = str(self.vllm_cfg.cpu_threads)
            extra_env.update(RLCORE_CPU_THREADS=threads, OMP_NUM_THREADS=threads)
        self.worker_group = RayWorkerGroup(
            cluster,
            WORKER_CLASS,
            sharding=self.sharding,
            name_prefix=name_prefix,
            init_args=(config, self.vllm_cfg),
            init_kwargs={
                **({"lora_rank": lora_rank} if lora_rank is not None else {}),
                **({"hf_overrides": dict(hf_config_overrides)} if hf_config_overrides else {}),
            }
            or None,
            extra_env=extra_env,
            kill_on_error=False,  # engines share no collective: one engine's exception leaves the others usable
            max_concurrency=ASYNC_ENGINE_CONCURRENCY if self.vllm_cfg.async_engine else 1,
        )
        # Actor construction is asynchronous: wait here so an engine that cannot start fails now.
        self.engine_info: list[dict[str, Any]] = self._all("info")
        # Set when a refit was dispatched: the next generate asks the engines whether it landed.
        self._refit_unchecked = any(info["stale"] for info in self.engine_info)
        # async_engine: rows submitted to each engine and not collected yet (routing of one-group batches)
        self._outstanding = [0] * self.num_engines
        self._routed: dict[int, tuple[int, int]] = {}  # id(handle) -> (engine, rows)
        self._routing = threading.Lock()  # rollout threads submit and collect side by side

    @property
    def num_engines(self) -> int:
        return self.sharding.dp

    # -- GenerationInterface ------------------------------------------------------------
    def generate(self, data: BatchedDataDict, greedy: bool = False) -> BatchedDataDict:
        """Generate for right-padded prompts; output rows are in the caller's order.

        See :meth:`rl_vllm.worker.VllmGenerationWorker.generate` for the
        semantics of greedy decoding, stop strings and logprobs.
        """
        return self.collect(self.generate_async(data, greedy))

    def generate_async(self, data: BatchedDataDict, greedy: bool = False) -> Any:
        """Submit to the engines and return at once (see ``GenerationInterface.generate_async``).

        Without ``async_engine`` each engine is a sync Ray actor: its calls run one at a time in submission
        order, so a refit submitted later waits for this request. With it, the requests join the engines'
        running batches at once; a batch of one sample group (every row the same prompt, or a single row) goes
        whole to the engine with the fewest rows outstanding, so the group shares its prompt's prefix cache;
        any other batch is cut into one chunk per engine, as without it.
        """
        problems = self._batch_problems(data)
        if problems:
            raise ValueError("; ".join(problems))
        self._check_not_stale()
        batch: BatchedDataDict[GenerationDatumSpec] = BatchedDataDict({k: data[k] for k in INPUT_KEYS if k in data})
        # call_id: the same on every rank of an engine, so a tensor-parallel engine's ranks know its requests alike
        kwargs = {"greedy": greedy, "sampling": sampling_options(self.cfg), "call_id": uuid.uuid4().hex}
        if self.vllm_cfg.async_engine and self.num_engines > 1 and _one_group(batch):
            rows = int(batch["input_ids"].shape[0])
            with self._routing:  # choose and count at once: another thread's group sees this one's rows
                engine = min(range(self.num_engines), key=lambda e: self._outstanding[e])
                self._outstanding[engine] += rows
            handle = self._run_on_engine(engine, batch, kwargs)
            with self._routing:
                self._routed[id(handle)] = (engine, rows)
            return handle
        shards = batch.chunk(self.num_engines)
        return self.worker_group.run_all_workers_sharded_data("generate", shards, **kwargs)

    def generate_groups_async(self, batches: Sequence[BatchedDataDict], greedy: bool = False) -> list[Any]:
        """Submit several sample groups at once; one handle per batch, for :meth:`collect` and
        :meth:`as_completed` (additive to ``GenerationInterface``: the core's ready-first rollouts use it when a
        backend has it). With ``async_engine`` at tensor_parallel_size 1, each engine gets one streaming call
        for all the groups routed to it (each group whole to the engine with the fewest rows outstanding): the
        engine admits them at one step and hands back each group as soon as it is done. Otherwise each batch is
        a :meth:`generate_async` call. A group's output is the one ``generate_async`` gives for that batch."""
        if not batches:
            return []
        if not self.vllm_cfg.async_engine or self.sharding.tp > 1:
            return [self.generate_async(batch, greedy) for batch in batches]
        problems = [f"sample group {i}: {p}" for i, batch in enumerate(batches) for p in self._batch_problems(batch)]
        if problems:
            raise ValueError("; ".join(problems))
        self._check_not_stale()
        kwargs = {"greedy": greedy, "sampling": sampling_options(self.cfg), "call_id": uuid.uuid4().hex}
        inputs: list[BatchedDataDict[GenerationDatumSpec]] = [
            BatchedDataDict({k: b[k] for k in INPUT_KEYS if k in b}) for b in batches
        ]
        rows = [int(batch["input_ids"].shape[0]) for batch in inputs]
        routed: list[list[int]] = [[] for _ in range(self.num_engines)]  # engine -> indexes into batches
        with self._routing:
            for index, count in enumerate(rows):
                engine = min(range(self.num_engines), key=lambda e: self._outstanding[e])
                self._outstanding[engine] += count
                routed[engine].append(index)
        handles: list[Any] = [None] * len(batches)
        for engine, indexes in enumerate(routed):
            if not indexes:
                continue
            try:
                stream = self.worker_group.run_streaming_on_worker(
                    engine, "generate_groups", [inputs[i] for i in indexes], **kwargs
                )
            except BaseException:
                with self._routing:  # nothing was sent to this engine
                    self._outstanding[engine] -= sum(rows[i] for i in indexes)
                raise
            shared = GroupStream(stream, len(indexes))
            for position, index in enumerate(indexes):
                handles[index] = StreamedGroup(shared, position, engine, rows[index])
        return handles

    def _batch_problems(self, data: BatchedDataDict) -> list[str]:
        """What keeps ``data`` from the engines (its shapes, its length, its images), checked here on the driver."""
        problems = batch_problems(data, min(info["max_model_len"] for info in self.engine_info))
        if problems:
            return problems
        image_token = self.engine_info[0].get("image_token_id")
        return image_batch_problems(data, image_token, getattr(self.cfg, "model_name", None))

    def _run_on_engine(self, engine: int, batch: BatchedDataDict, kwargs: dict[str, Any]) -> Any:
        """``generate`` on every rank of one engine (through the group's own dispatch, its checks); the result
        is tensor-parallel rank 0's, the others' calls are waited on (a failure anywhere surfaces)."""
        tp = self.sharding.tp
        if tp == 1:
            return self.worker_group.run_on_worker(engine, "generate", batch, **kwargs)
        ranks = [self.sharding.rank(dp=engine, tp=t) for t in range(tp)]
        calls = [self.worker_group.run_on_worker(rank, "generate", batch, **kwargs) for rank in ranks]
        refs = [ref for call in calls for ref in call.refs]
        return Calls(refs, ranks, [ranks[0]])

    def collect(self, handle: Any) -> BatchedDataDict:
        """The output of a :meth:`generate_async` call, with ``weight_version`` per sample (and, per token,
        ``generation_weight_versions``)."""
        try:
            if isinstance(handle, StreamedGroup):
                return collect_streamed(handle, self.worker_group)
            return BatchedDataDict.from_batches(self.worker_group.get_results(handle))
        finally:
            self._release(handle)

    def _release(self, handle: Any) -> None:
        with self._routing:
            if isinstance(handle, StreamedGroup):
                self._outstanding[handle.engine] -= handle.rows
                return
            routed = self._routed.pop(id(handle), None)
            if routed is not None:
                self._outstanding[routed[0]] -= routed[1]

    def as_completed(
        self, handles: Sequence[Any], timeout_s: float | None = None
    ) -> Iterator[tuple[int, BatchedDataDict]]:
        """``(index, output)`` of each handle as soon as all its engines are done (ready-first);
        ``TimeoutError`` when none more is done within ``timeout_s``. A rank's failure (a tensor-parallel
        engine's follower that raised or died) is raised as soon as it is known, not after the other ranks.
        Handles of :meth:`generate_groups_async` are taken from their streams as the engines yield them."""
        import ray

        owner = {ref: i for i, handle in enumerate(handles) for ref in handle.refs}
        left = {i: len(handle.refs) for i, handle in enumerate(handles) if not isinstance(handle, StreamedGroup)}
        streamed = {i: handle for i, handle in enumerate(handles) if isinstance(handle, StreamedGroup)}
        streams = {id(h.stream): h.stream for h in streamed.values()}
        while left or streamed:
            for index in [i for i, h in streamed.items() if h.stream.has(h.index)]:  # taken already
                del streamed[index]
                yield index, self.collect(handles[index])
            if not left and not streamed:
                return
            waiting = {stream.generator: stream for key, stream in streams.items() if _wanted(stream, streamed)}
            pending = [ref for ref in owner if owner[ref] in left] + list(waiting)
            ready, _ = ray.wait(pending, num_returns=1, timeout=timeout_s)
            if not ready:
                outstanding = len(left) + len(streamed)
                raise TimeoutError(f"no generation request finished within {timeout_s}s ({outstanding} outstanding)")
            if ready[0] in waiting:
                waiting[ready[0]].take(self.worker_group, 0)  # its next output (or its end, or its failure)
                continue
            index = owner.pop(ready[0])
            left[index] -= 1
            if left[index] and _failed(ready[0]):
                left[index] = 0
                owner = {ref: i for ref, i in owner.items() if i != index}
            if not left[index]:
                del left[index]
                yield index, self.collect(handles[index])  # raises a rank's failure, naming it

    @property
    def continuous_serving(self) -> bool:
        """``vllm_cfg.async_engine``: the engines serve requests continuously."""
        return self.vllm_cfg.async_engine

    def pause_generation(self, mode: PauseMode = "wait", timeout_s: float | None = None) -> None:
        """Pause every engine (see ``GenerationInterface.pause_generation``). When one does not pause within
        ``timeout_s``, the others are resumed and ``TimeoutError`` names the engines that did not."""
        import ray

        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r}: one of {list(PAUSE_MODES)}")
        self._require_async_engine("pause_generation")
        refs = self.worker_group.run_all_workers_single_data("pause_generation", mode, timeout_s).refs
        late = []
        for ref in refs:
            try:
                ray.get(ref)
            except TimeoutError as exc:  # Ray's task error is also a TimeoutError
                late.append(str(getattr(exc, "cause", exc)))
        if late:
            self._all("resume_generation")
            raise TimeoutError("; ".join(dict.fromkeys(late)))  # a tensor-parallel engine's ranks raise alike

    def resume_generation(self, recompute_kv_cache: bool = False) -> None:
        """Resume every engine; ``recompute_kv_cache``: kept requests prefill again with the current weights."""
        self._require_async_engine("resume_generation")
        self._all("resume_generation", recompute_kv_cache)

    def _require_async_engine(self, method: str) -> None:
        if not self.vllm_cfg.async_engine:
            raise RuntimeError(
                f"{method} needs policy.generation.vllm_cfg.async_engine: true (these engines run one blocking "
                "llm.generate per batch; there is nothing to pause)"
            )

    def set_weight_version(self, version: int) -> None:
        """Queued behind the refit it names (and any request before it): later requests are tagged ``version``."""
        self._all("set_weight_version", version)

    def weight_fingerprints(self) -> list[dict[str, Any]]:
        """``verified_refit``: per engine, the ``weight_version`` it holds and the fingerprints of the tensors its
        refits delivered (``{"weight_version": int, "fingerprints": {name: int}}``)."""
        return self._all("weight_fingerprints")

    def _check_not_stale(self) -> None:
        """Raise here, on the driver, if a refit left an engine stale.

        Checked on the driver because an exception raised inside an engine
        actor makes the worker group unusable, and a stale engine must come
        back to service after the next successful refit.
        """
        if not self._refit_unchecked:
            return
        reasons = [(rank, r) for rank, r in enumerate(self._all("refit_status")) if r is not None]
        if reasons:
            raise EngineStaleError(
                "; ".join(f"engine {rank} cannot generate: {r}" for rank, r in reasons)
                + "; run a successful weight refit first"
            )
        self._refit_unchecked = False

    def prepare_for_generation(self, *args: Any, **kwargs: Any) -> bool:
        """Wake the engines (GPU sleep mode); on CPU a no-op that returns True."""
        return all(self._all("prepare_for_generation"))

    def finish_generation(self, *args: Any, **kwargs: Any) -> bool:
        """Let the engines sleep (GPU sleep mode); on CPU a no-op that returns True (nothing to free)."""
        return all(self._all("finish_generation"))

    # -- weight refit (receiving side; rlcore.refit.WeightSynchronizer drives it) ----------
    def prepare_refit_info(self, state_dict_info: dict[str, Any], partial: bool = False) -> None:
        """Give every engine ``{hf_name: (shape, dtype)}``; raises :class:`RefitError` if it cannot fit.

        Checked against each engine's checkpoint (names and shapes) before any
        weight changes; nothing is applied when it is refused. ``partial``: the
        refits that follow send only these tensors (the rest keep their values).
        """
        problems = self._all("prepare_refit_info", state_dict_info, partial=partial)
        lines = [f"engine {rank}: {p}" for rank, ps in enumerate(problems) for p in ps]
        if lines:
            raise RefitError("refit info refused, no weight changed: " + "; ".join(lines[:5]))

    def load_lora_adapter(self, path: str, version: int) -> None:
        """Every engine loads the PEFT adapter directory ``path`` (on a filesystem the engines share with
        the training rank that wrote it) and runs every later request with it (adapter refit)."""
        self._all("load_lora_adapter", path, version)

    def refit_world_size(self) -> int:
        """Engine ranks that join the collective refit group."""
        return self.worker_group.world_size

    def refit_endpoints(self) -> dict[int, tuple[str, bytes]]:
        """``{training rank: (socket address, key)}`` of the engine sharing that rank's bundle.

        Engine rank ``r`` runs in bundle ``r``, and so does training rank
        ``r`` when both groups are placed on the same (colocated) cluster.
        """
        return dict(enumerate(self._all("refit_endpoint")))

    def update_weights_via_ipc_zmq(self, bucket_bytes: int | None = None) -> list[Any]:
        """Start every engine's shared-memory receiver; returns the Ray refs to wait on.

        A failed refit raises from those refs (:class:`RefitError`) and leaves
        the engines that had started loading stale: ``generate`` then raises
        :class:`EngineStaleError` until a refit succeeds.
        """
        self._refit_unchecked = True
        return self.worker_group.run_all_workers_single_data(
            "update_weights_via_ipc_zmq", bucket_bytes=bucket_bytes
        ).refs

    def init_collective(self, ip: str, port: int, world_size: int, *, train_world_size: int) -> list[Any]:
        """Engines join the refit group as ranks ``train_world_size + r``; returns the Ray refs."""
        return self.worker_group.run_all_workers_single_data(
            "init_collective", ip, port, world_size, train_world_size=train_world_size
        ).refs

    def update_weights_from_collective(self, bucket_bytes: int | None = None) -> list[Any]:
        """Engines receive the broadcast refit; returns the Ray refs (see ``update_weights_via_ipc_zmq``)."""
        self._refit_unchecked = True
        return self.worker_group.run_all_workers_single_data(
            "update_weights_from_collective", bucket_bytes=bucket_bytes
        ).refs


def _wanted(stream: GroupStream, streamed: dict[int, StreamedGroup]) -> bool:
    """Some handle asked for is still to come from ``stream``."""
    return any(h.stream is stream and not stream.has(h.index) for h in streamed.values())


def _failed(ref: Any) -> bool:
    """A finished call that raised (or whose actor died)."""
    import ray

    try:
        ray.get(ref, timeout=0)
    except ray.exceptions.GetTimeoutError:
        return False
    except Exception:  # noqa: BLE001 - any failure: the caller raises it through collect, named
        return True
    return False


def _one_group(batch: BatchedDataDict) -> bool:
    """One sample group: a single row, or every row the same prompt (a group's samples of one prompt)."""
    ids, lengths = batch["input_ids"], batch["input_lengths"]
    if ids.shape[0] <= 1:
        return True
    return bool((lengths == lengths[0]).all()) and bool((ids[:, : int(lengths[0])] == ids[:1, : int(lengths[0])]).all())
