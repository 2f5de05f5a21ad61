"""``VllmGenerationWorker``: one vLLM engine, living inside one Ray actor.

The engine runs in the actor's own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``):
it starts in a few seconds instead of 15-25 (no engine-core process to spawn
and connect to), and its model is a plain ``nn.Module`` in this process, so a
weight refit can load tensors into it in place.

This module is imported only inside the actor (it imports torch and vLLM).
"""

from __future__ import annotations

import os
import time
from typing import Any

from rl_vllm.config import VllmConfig
from rl_vllm.cpu_setup import request_amx_permission
from rl_vllm.sampling import Completion, pack_outputs, prompts_from_batch, request_stop_strings


def _prepare_process_env(cfg: VllmConfig, on_cpu: bool) -> None:
    """Environment the in-process engine reads when it starts (design.md §5)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # The engine is a single in-process rank: nothing needs to reach it from another host.
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    if cfg.kv_cache_space_gb is not None:
        # The legacy variable (whole GiB only) would override the size the config asks for.
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    if on_cpu:
        # Several ranks share few cores: never let the engine pin OpenMP threads to cores.
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


class EngineStaleError(RuntimeError):
    """The engine's weights are not the ones it was asked to hold (a refit failed part-way)."""


class VllmGenerationWorker:
    """One data-parallel rank of the ``vllm`` backend: an in-process ``vllm.LLM``.

    ``generation_config`` is rlcore's ``GenerationConfig`` (its sampling
    fields are the defaults of every call; the facade sends the current ones
    with each call), ``vllm_config`` the validated ``vllm_cfg`` section.
    """

    def __init__(self, generation_config: Any, vllm_config: VllmConfig, *, engine_rank: int | None = None) -> None:
        import torch

        self.rank = int(os.environ.get("RANK", 0)) if engine_rank is None else engine_rank
        self.gen_cfg = generation_config
        self.cfg = vllm_config
        on_cpu = not torch.cuda.is_available()
        _prepare_process_env(vllm_config, on_cpu)
        if on_cpu:
            if vllm_config.cpu_threads:
                torch.set_num_threads(vllm_config.cpu_threads)
            request_amx_permission()  # bf16 kernels SIGILL without it (the entry point covers spawned processes)

        from vllm import LLM

        model = generation_config.model_name
        if not model:
            raise ValueError("policy.generation.model_name is not set (it defaults to policy.model_name)")
        kwargs: dict[str, Any] = dict(
            model=model,
            tokenizer=vllm_config.tokenizer or model,
            dtype=vllm_config.precision,
            seed=vllm_config.seed + self.rank,
            enforce_eager=vllm_config.enforce_eager,
            max_model_len=vllm_config.max_model_len,
            kv_cache_memory_bytes=vllm_config.kv_cache_bytes,
            gpu_memory_utilization=vllm_config.gpu_memory_utilization,
            enable_prefix_caching=vllm_config.enable_prefix_caching,
            load_format=vllm_config.load_format,
            # Logprobs of the distribution tokens are drawn from (temperature, top-k/top-p applied),
            # which is what the policy compares against (design.md §2.2).
            logprobs_mode="processed_logprobs",
            tensor_parallel_size=vllm_config.tensor_parallel_size,
        )
        if vllm_config.enable_sleep_mode and not on_cpu:
            kwargs["enable_sleep_mode"] = True
        self._sleep_mode = bool(kwargs.get("enable_sleep_mode"))
        self._asleep = False
        if vllm_config.max_num_seqs is not None:
            kwargs["max_num_seqs"] = vllm_config.max_num_seqs
        kwargs.update(vllm_config.engine_kwargs)
        started = time.perf_counter()
        self.llm = LLM(**kwargs)
        self.start_seconds = time.perf_counter() - started
        self.max_model_len = int(self.llm.model_config.max_model_len)
        tokenizer = self.llm.get_tokenizer()
        self.default_pad_id = next(
            (t for t in (getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None))
             if t is not None), 0)
        # Weights that did not come from a checkpoint are not the policy's until a refit lands.
        self.stale_reason: str | None = (
            "the engine started with load_format='dummy' and has not been refit yet"
            if vllm_config.load_format == "dummy" else None)

    # -- generation -----------------------------------------------------------------
    def _sampling_params(self, options: dict[str, Any], greedy: bool, stops: list[str],
                         max_tokens: int) -> Any:
        from vllm import SamplingParams

        temperature = 0.0 if greedy else float(options["temperature"])
        return SamplingParams(
            n=1,
            temperature=temperature,
            top_p=1.0 if temperature == 0 else float(options["top_p"]),
            top_k=0 if temperature == 0 or options["top_k"] is None else int(options["top_k"]),
            max_tokens=max_tokens,
            stop_token_ids=list(options["stop_token_ids"] or []),
            stop=stops or None,
            include_stop_str_in_output=True,
            logprobs=0,  # the sampled token's own logprob only
            detokenize=bool(stops),  # stop strings are matched on text; nothing else needs it
        )

    def generate(self, data: Any, greedy: bool = False, sampling: dict[str, Any] | None = None) -> Any:
        """Generate for a right-padded batch; returns a ``GenerationOutputSpec`` BatchedDataDict.

        ``sampling`` holds the ``GenerationConfig`` sampling fields for this
        call (default: the ones this worker was built with). ``greedy`` means
        temperature 0 (argmax); its logprobs are then those of the
        unscaled distribution. Stop strings (the config's and the sample's
        own ``stop_strings``) end a completion with the token that completes
        the string, which is kept. An EOS or stop token is kept too.
        """
        import torch

        from rlcore.data import BatchedDataDict
        from rl_vllm.sampling import SAMPLING_FIELDS, sampling_options

        if self._asleep:
            self.prepare_for_generation()
        if self.stale_reason is not None:
            raise EngineStaleError(f"engine {self.rank} cannot generate: {self.stale_reason}; "
                                   "run a successful weight refit first")
        options = sampling_options(self.gen_cfg) if sampling is None else {**sampling_options(self.gen_cfg),
                                                                          **sampling}
        unknown = set(options) - set(SAMPLING_FIELDS)
        if unknown:
            raise ValueError(f"unknown sampling options {sorted(unknown)}")
        input_ids = data["input_ids"].cpu()
        input_lengths = data["input_lengths"].cpu()
        max_new = int(options["max_new_tokens"])
        pad_id = options["pad_token_id"] if options["pad_token_id"] is not None else self.default_pad_id
        prompts = prompts_from_batch(input_ids, input_lengths)
        stops = request_stop_strings(options["stop_strings"], data.get("stop_strings"), len(prompts))

        params, requests = [], []
        for i, (prompt, stop) in enumerate(zip(prompts, stops)):
            room = self.max_model_len - len(prompt)
            if room < 1:
                raise ValueError(f"prompt {i} has {len(prompt)} tokens; the engine's max_model_len is "
                                 f"{self.max_model_len} (policy.generation.vllm_cfg.max_model_len)")
            params.append(self._sampling_params(options, greedy, stop, min(max_new, room)))
            requests.append({"prompt_token_ids": prompt})

        results = self.llm.generate(requests, params, use_tqdm=False) if requests else []
        completions = []
        for result in results:
            out = result.outputs[0]
            tokens = list(out.token_ids)
            lps = [float(step[tok].logprob) for tok, step in zip(tokens, out.logprobs or [])]
            completions.append(Completion(tokens, lps, out.finish_reason))
        packed = pack_outputs(input_ids, input_lengths, completions, max_new, int(pad_id))
        return BatchedDataDict(packed)

    # -- lifecycle --------------------------------------------------------------------
    def prepare_for_generation(self, *args: Any, **kwargs: Any) -> bool:
        """Wake the engine if it sleeps (GPU with ``enable_sleep_mode``); otherwise a no-op.

        vLLM's CPU worker has no sleep mode (its ``sleep``/``wake_up`` free
        nothing), so on CPU the engine simply stays resident.
        """
        if self._sleep_mode and self._asleep:
            self.llm.wake_up()
            self._asleep = False
        return True

    def finish_generation(self, *args: Any, **kwargs: Any) -> bool:
        """Put the engine to sleep (level 1: weights offloaded, KV cache dropped) where supported."""
        if self._sleep_mode and not self._asleep:
            self.llm.reset_prefix_cache()
            self.llm.sleep(level=1)
            self._asleep = True
        return True

    def info(self) -> dict[str, Any]:
        """Facts about this engine, for logs and tests."""
        return {"rank": self.rank, "pid": os.getpid(), "start_seconds": self.start_seconds,
                "max_model_len": self.max_model_len, "stale": self.stale_reason}

    def is_alive(self) -> bool:
        return True

    def shutdown(self) -> bool:
        llm = getattr(self, "llm", None)
        if llm is not None:
            del self.llm
            import gc

            gc.collect()
        return True
