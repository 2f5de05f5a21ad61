"""``VllmGenerationWorker``: one vLLM engine, living inside one Ray actor.

The engine runs in the actor's own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``):
it starts in a few seconds instead of 15-25 (no engine-core process to spawn
and connect to), and its model is a plain ``nn.Module`` in this process, so a
weight refit can load tensors into it in place.

The worker's refit calls are :class:`rl_vllm.engine_refit.EngineRefit`'s, its continuous serving
(``vllm_cfg.async_engine``) :class:`rl_vllm.serving.EngineLifecycle`'s; this module starts the engine and
generates. It is imported only inside the actor (it imports torch and vLLM).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any

from rl_vllm.config import VllmConfig
from rl_vllm.cpu_setup import request_amx_permission
from rl_vllm.engine_env import EngineRank, name_segments_uniquely, prepare_process_env, unlink_rank_segments
from rl_vllm.engine_loop import EngineLoop
from rl_vllm.engine_refit import EngineRefit
from rl_vllm.kv_capacity import KvCapacity
from rl_vllm.multimodal import check_engine_prompts, engine_requests, enter_vision_engine
from rl_vllm.refit import EngineStaleError
from rl_vllm.sampling import (
    pack_outputs,
    prompts_from_batch,
    request_seeds,
    request_stop_strings,
)
from rl_vllm.serving import EngineLifecycle, PreparedBatch, token_versions
from rlcore.refit.buckets import Regions

logger = logging.getLogger(__name__)

#: KV-cache block size on CPU (vLLM's CPU default is 128; its CPU attention takes multiples of 32). The prefix
#: cache shares whole blocks only, so a prompt shorter than a block is prefilled once per copy: a GRPO group's
#: copies of a 100-token prompt share nothing at 128 and 96 tokens at 32, even when admitted in one step.
#: Measured (a 50M Llama, 16 prompts x 8 copies of 100 tokens, one thread): prefill 3.9 s at 32 against 26.6 s
#: at 128; 64 decode steps 17.0-17.3 s against 17.9-18.6 s. ``vllm_cfg.engine_kwargs.block_size`` overrides it.
CPU_BLOCK_SIZE = 32


def vllm_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds adapters of ``rank``."""
    from typing import get_args

    from vllm.config.lora import MaxLoRARanks

    allowed = sorted(get_args(MaxLoRARanks))
    fitting = [r for r in allowed if r >= rank]
    if not fitting:
        raise ValueError(f"policy.lora.dim={rank}: vLLM runs LoRA adapters of rank up to {allowed[-1]}")
    return fitting[0]


class VllmGenerationWorker(EngineLifecycle, EngineRefit):
    """One data-parallel rank of the ``vllm`` backend: an in-process ``vllm.LLM``.

    ``generation_config`` is rlcore's ``GenerationConfig`` (its sampling
    fields are the defaults of every call; the facade sends the current ones
    with each call), ``vllm_config`` the validated ``vllm_cfg`` section.
    """

    def __init__(
        self,
        generation_config: Any,
        vllm_config: VllmConfig,
        *,
        engine_rank: int | None = None,
        lora_rank: int | None = None,
        hf_overrides: dict[str, Any] | None = None,
    ) -> None:
        import torch

        self.rank = int(os.environ.get("RANK", 0)) if engine_rank is None else engine_rank
        self.gen_cfg = generation_config
        self.cfg = vllm_config
        self.place = EngineRank(self.rank, vllm_config.tensor_parallel_size)
        on_cpu = not torch.cuda.is_available()
        kv_cache_bytes = prepare_process_env(vllm_config, on_cpu, self.place)
        if on_cpu:
            if vllm_config.cpu_threads:
                torch.set_num_threads(vllm_config.cpu_threads)
            request_amx_permission()  # bf16 kernels SIGILL without it (the entry point covers spawned processes)
            if vllm_config.enforce_eager:  # vLLM's own compiled helpers too (see VllmConfig.enforce_eager)
                torch.compiler.set_stance("force_eager")

        started = time.perf_counter()
        from vllm import LLM

        self.import_seconds = time.perf_counter() - started
        model = generation_config.model_name
        if not model:
            raise ValueError("policy.generation.model_name is not set (it defaults to policy.model_name)")
        kwargs: dict[str, Any] = dict(
            model=model,
            tokenizer=vllm_config.tokenizer or model,
            dtype=vllm_config.precision,
            seed=vllm_config.seed + self.place.engine,  # the same on every rank of one engine: they sample alike
            enforce_eager=vllm_config.enforce_eager,
            max_model_len=vllm_config.max_model_len,
            kv_cache_memory_bytes=kv_cache_bytes,
            gpu_memory_utilization=vllm_config.gpu_memory_utilization,
            enable_prefix_caching=vllm_config.enable_prefix_caching,
            load_format=vllm_config.load_format,
            # Default: logprobs of the distribution tokens are drawn from (temperature, top-k/top-p applied),
            # which is what the policy compares against (design.md §2.2); see VllmConfig.logprobs_mode.
            logprobs_mode=vllm_config.logprobs_mode,
            tensor_parallel_size=vllm_config.tensor_parallel_size,
        )
        if vllm_config.tensor_parallel_size > 1:  # this actor is one rank of the engine (see rl_vllm.engine_env)
            kwargs["distributed_executor_backend"] = "external_launcher"
            if on_cpu:
                name_segments_uniquely()
        if on_cpu:  # vLLM's CPU sampler cannot rewind a seeded request's generator (set_offset) between the chunks
            kwargs["enable_chunked_prefill"] = False  # of a prompt, and every request has a seed: whole prefills
            kwargs["block_size"] = CPU_BLOCK_SIZE
        if vllm_config.enable_sleep_mode and not on_cpu:
            kwargs["enable_sleep_mode"] = True
        self._sleep_mode = bool(kwargs.get("enable_sleep_mode"))
        self._asleep = False
        if vllm_config.max_num_seqs is not None:
            kwargs["max_num_seqs"] = vllm_config.max_num_seqs
        if hf_overrides:  # policy.hf_config_overrides: the engine's model config must be the trainer's
            kwargs["hf_overrides"] = dict(hf_overrides)
        if lora_rank is not None:  # adapter refit: the policy's adapters run as vLLM LoRA modules
            kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=vllm_lora_rank(lora_rank))
        # a vision-language model: image limits, and (without torchvision) the CPU shim for the engine's whole life
        self._vision = contextlib.ExitStack()
        self.image_token_id, multimodal = enter_vision_engine(model, vllm_config.limit_mm_per_prompt, self._vision)
        kwargs.update(multimodal)
        kwargs.update(vllm_config.engine_kwargs)
        started = time.perf_counter()
        try:
            self.llm = LLM(**kwargs)
        except BaseException:
            self._vision.close()
            raise
        if vllm_config.tensor_parallel_size > 1:
            unlink_rank_segments()
        self.start_seconds = time.perf_counter() - started
        self.max_model_len = int(self.llm.model_config.max_model_len)
        self.kv_capacity = KvCapacity.of(self.llm)
        self._kv_cache_space_gb = vllm_config.kv_cache_space_gb
        self._warned_kv_shortfall = False
        tokenizer = self.llm.get_tokenizer()
        self.default_pad_id = next(
            (
                t
                for t in (getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None))
                if t is not None
            ),
            0,
        )
        self.refit_metadata: dict[str, Any] | None = None
        self._partial_refit = False  # the refits' plan covers part of the model (prepare_refit_info)
        self._receiver: Any = None
        self._refit_group: Any = None
        self._lora_request: Any = None  # the adapter every request runs with (adapter refit)
        self.weight_version = 0  # named by the driver after each refit; tags every sample generated
        self._fingerprints: dict[str, int] = {}  # verified_refit: what the refits delivered, by tensor
        # At tensor_parallel_size > 1: the slices of the refit's tensors this rank's loaders read (recorded
        # in the first whole refit); colocated refits after it send only those.
        self._read_regions: Regions | None = None
        # Weights that did not come from a checkpoint are not the policy's until a refit lands.
        self.stale_reason: str | None = (
            "the engine started with load_format='dummy' and has not been refit yet"
            if vllm_config.load_format == "dummy"
            else None
        )
        # vllm_cfg.async_engine: a thread serves the engine continuously (rl_vllm.engine_loop)
        self._loop: EngineLoop | None = self._engine_loop() if vllm_config.async_engine else None

    # -- generation -----------------------------------------------------------------
    def _sampling_params(
        self, options: dict[str, Any], greedy: bool, stops: list[str], max_tokens: int, seed: int | None = None
    ) -> Any:
        from vllm import SamplingParams

        temperature = 0.0 if greedy else float(options["temperature"])
        return SamplingParams(
            n=1,
            seed=None if temperature == 0 else seed,  # a request's own generator (sampling_seeds)
            temperature=temperature,
            top_p=1.0 if temperature == 0 else float(options["top_p"]),
            top_k=0 if temperature == 0 or options["top_k"] is None else int(options["top_k"]),
            max_tokens=max_tokens,
            stop_token_ids=list(options["stop_token_ids"] or []),
            stop=stops or None,
            include_stop_str_in_output=True,
            logprobs=0,  # the sampled token's own logprob only
            flat_logprobs=True,  # flat lists instead of a dict and a Logprob object per generated token
            detokenize=bool(stops),  # stop strings are matched on text; nothing else needs it
        )

    def generate(
        self, data: Any, greedy: bool = False, sampling: dict[str, Any] | None = None, call_id: str | None = None
    ) -> Any:
        """Generate for a right-padded batch; returns a ``GenerationOutputSpec`` BatchedDataDict.

        ``sampling`` holds the ``GenerationConfig`` sampling fields for this
        call (default: the ones this worker was built with). ``greedy`` means
        temperature 0 (argmax); its logprobs are then those of the
        unscaled distribution. Stop strings (the config's and the sample's
        own ``stop_strings``) end a completion with the token that completes
        the string, which is kept. An EOS or stop token is kept too. ``call_id`` names the call on every rank
        of a tensor-parallel ``async_engine`` engine (the facade sends each rank the same one).
        """
        request = self._prepared(data, greedy, sampling)
        started = time.time()
        if self._loop is not None:
            completions, versions = self._serve(request.requests, request.params, call_id)
        else:
            completions, versions = self._generate_batch(request.requests, request.params)
        return self._packed(request, completions, versions, (started, time.time()))

    def _prepared(self, data: Any, greedy: bool, sampling: dict[str, Any] | None) -> PreparedBatch:
        """``data``'s prompts and each one's ``SamplingParams`` (see :meth:`generate`); raises what cannot run."""
        from rl_vllm.sampling import SAMPLING_FIELDS, sampling_options

        if self._asleep:
            self.prepare_for_generation()
        if self.stale_reason is not None:
            raise EngineStaleError(
                f"engine {self.rank} cannot generate: {self.stale_reason}; run a successful weight refit first"
            )
        options = sampling_options(self.gen_cfg) if sampling is None else {**sampling_options(self.gen_cfg), **sampling}
        unknown = set(options) - set(SAMPLING_FIELDS)
        if unknown:
            raise ValueError(f"unknown sampling options {sorted(unknown)}")
        input_ids = data["input_ids"].cpu()
        input_lengths = data["input_lengths"].cpu()
        max_new = int(options["max_new_tokens"])
        pad_id = options["pad_token_id"] if options["pad_token_id"] is not None else self.default_pad_id
        prompts = prompts_from_batch(input_ids, input_lengths)
        stops = request_stop_strings(options["stop_strings"], data.get("stop_strings"), len(prompts))
        seeds = request_seeds(data, len(prompts))

        params = []
        for i, (prompt, stop) in enumerate(zip(prompts, stops)):
            room = self.max_model_len - len(prompt)
            if room < 1:
                raise ValueError(
                    f"prompt {i} has {len(prompt)} tokens; the engine's max_model_len is "
                    f"{self.max_model_len} (policy.generation.vllm_cfg.max_model_len)"
                )
            params.append(self._sampling_params(options, greedy, stop, min(max_new, room), seeds[i]))
        self._warn_kv_shortfall([len(p) for p in prompts], [p.max_tokens for p in params])
        requests = engine_requests(prompts, data.get("images"), self.image_token_id)  # images: docs/vision.md
        return PreparedBatch(input_ids, input_lengths, prompts, params, max_new, int(pad_id), list(requests))

    def _packed(
        self, request: PreparedBatch, completions: list[Any], versions: list[list[int]], window: tuple[float, float]
    ) -> Any:
        """The ``GenerationOutputSpec`` batch of ``request``'s completions (with versions and the call's window)."""
        import torch

        from rlcore.data import BatchedDataDict

        check_engine_prompts(request.requests, request.prompts, [c.prompt_token_ids for c in completions])
        ids, lengths = request.input_ids, request.input_lengths
        packed = pack_outputs(ids, lengths, completions, request.max_new, request.pad_id)
        packed.update(token_versions(lengths, versions, packed["output_ids"].shape[1], self.weight_version))
        packed["generation_window"] = torch.tensor(window, dtype=torch.float64).repeat(len(request.prompts), 1)
        return BatchedDataDict(packed)

    def _warn_kv_shortfall(self, prompt_lengths: list[int], max_tokens: list[int]) -> None:
        """Once per engine: the first batch that cannot run at once in the KV cache (see kv_capacity)."""
        if self._warned_kv_shortfall:
            return
        problem = self.kv_capacity.shortfall(prompt_lengths, max_tokens, self._kv_cache_space_gb)
        if problem:
            logger.warning("engine %s: %s", self.rank, problem)
            self._warned_kv_shortfall = True

    def set_weight_version(self, version: int) -> None:
        self.weight_version = int(version)

    # -- lifecycle --------------------------------------------------------------------
    def prepare_for_generation(self, *args: Any, **kwargs: Any) -> bool:
        """Wake the engine if it sleeps (GPU with ``enable_sleep_mode``); otherwise a no-op.

        vLLM's CPU worker has no sleep mode (its ``sleep``/``wake_up`` free
        nothing), so on CPU the engine simply stays resident.
        """
        if self._sleep_mode and self._asleep:
            with self._exclusive():
                self.llm.wake_up()
            self._asleep = False
        return True

    def finish_generation(self, *args: Any, **kwargs: Any) -> bool:
        """Put the engine to sleep (level 1: weights offloaded, KV cache dropped) where supported."""
        if self._sleep_mode and not self._asleep:
            with self._exclusive():
                self.llm.reset_prefix_cache()
                self.llm.sleep(level=1)
            self._asleep = True
        return True

    def info(self) -> dict[str, Any]:
        """Facts about this engine, for logs and tests."""
        return {
            "rank": self.rank,
            "pid": os.getpid(),
            "start_seconds": self.start_seconds,
            "import_seconds": self.import_seconds,
            "max_model_len": self.max_model_len,
            "stale": self.stale_reason,
            "kv_cache_blocks": self.kv_capacity.num_blocks,
            "kv_block_size": self.kv_capacity.block_size,
            "max_num_seqs": self.kv_capacity.max_num_seqs,
            "async_engine": self._loop is not None,
            "image_token_id": self.image_token_id,  # None: a text model
            "compiled_frames": _compiled_frames(),
        }

    def is_alive(self) -> bool:
        return True

    def shutdown(self) -> bool:
        loop = getattr(self, "_loop", None)
        if loop is not None:
            loop.stop()
            self._loop = None
        receiver = getattr(self, "_receiver", None)
        if receiver is not None:
            receiver.close()
            self._receiver = None
        llm = getattr(self, "llm", None)
        if llm is not None:
            del self.llm
            import gc

            from rl_vllm.engine_env import remove_own_ipc_dir

            gc.collect()
            remove_own_ipc_dir()  # its sockets went with the engine
        vision = getattr(self, "_vision", None)
        if vision is not None:
            vision.close()  # the CPU shim outlives the engine, never the reverse
        return True


def _compiled_frames() -> int:
    """Frames torch.compile has compiled in this process so far (0 where vLLM's compiled helpers run eagerly:
    ``VllmConfig.enforce_eager`` on CPU)."""
    import sys

    if "torch._dynamo" not in sys.modules:
        return 0
    from torch._dynamo.utils import counters

    return int(counters["frames"]["ok"])
