"""How requests reach a worker's engine (one blocking ``llm.generate`` per batch, or the engine loop), and the
engine lifecycle of a ``vllm_cfg.async_engine`` worker: requests served by its engine loop, pause and
resume, and holding the engine for a refit (:class:`EngineLifecycle`, mixed into ``VllmGenerationWorker``); and the
per-token weight versions of an output (:func:`token_versions`).

Imported only inside the engine actor (with the worker); vLLM and torch are imported inside the functions.
"""

from __future__ import annotations

import contextlib
import functools
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal

from rl_vllm.engine_env import EngineRank
from rl_vllm.engine_loop import EngineLoop
from rl_vllm.engine_progress import progress_reader
from rl_vllm.sampling import Completion, sampled_logprobs
from rl_vllm.served import Prompt, Served


@dataclass
class PreparedBatch:
    """A batch ready for the engine: its right-padded prompts (as sent, on the CPU), each prompt's tokens and
    ``SamplingParams``, what packing the outputs needs, and each row's prompt as vLLM gets it (``requests``: the
    tokens, or for a row with images the collapsed tokens and the images, ``rl_vllm.multimodal.engine_requests``).
    """

    input_ids: Any
    input_lengths: Any
    prompts: list[list[int]]
    params: list[Any]
    max_new: int
    pad_id: int
    requests: list[Any]


class EngineLifecycle:
    """The ``async_engine`` part of ``VllmGenerationWorker``: ``_loop`` is its engine loop (None: a sync engine)."""

    rank: int
    place: EngineRank
    _loop: EngineLoop | None
    llm: Any
    weight_version: int
    _lora_request: Any

    def _prepared(self, data: Any, greedy: bool, sampling: dict[str, Any] | None) -> PreparedBatch:
        raise NotImplementedError  # the worker's

    def _packed(
        self, request: PreparedBatch, completions: list[Any], versions: list[list[int]], window: tuple[float, float]
    ) -> Any:
        raise NotImplementedError  # the worker's

    def generate_groups(
        self,
        batches: Sequence[Any],
        greedy: bool = False,
        sampling: dict[str, Any] | None = None,
        call_id: str | None = None,
    ) -> Iterator[tuple[int, Any]]:
        """``generate`` for several sample groups in one call: every group's requests are queued at once (the
        loop admits them together, at its next step), and ``(index into batches, output)`` is yielded for each
        group as soon as its own requests are done, so a streaming Ray call hands back each group as it finishes.
        A group's output is :meth:`generate`'s for that batch alone (the same requests; ``generation_window``
        from the call's start to the group's end). A failed request ends the stream with its error."""
        loop = self._require_loop("generate_groups")
        prepared = [self._prepared(batch, greedy, sampling) for batch in batches]  # all checked before any runs
        output_kind = _output_kind(loop)
        started = time.time()
        requests = []
        for group, request in enumerate(prepared):
            for row, (prompt, param) in enumerate(zip(request.requests, request.params)):
                param.output_kind = output_kind
                requests.append((prompt, param, None if call_id is None else f"{call_id}:{group}:{row}"))
        futures = loop.submit_all(requests)
        finished: queue.SimpleQueue[int] = queue.SimpleQueue()
        left = [len(request.prompts) for request in prepared]
        owners = [group for group, request in enumerate(prepared) for _ in request.prompts]
        by_group: list[list[Future[Any]]] = [[] for _ in prepared]
        for future, group in zip(futures, owners):
            by_group[group].append(future)

        counting = threading.Lock()  # done callbacks run in whichever thread ended the request

        def count(group: int) -> None:
            with counting:
                left[group] -= 1
                last = not left[group]
            if last:
                finished.put(group)

        for future, group in zip(futures, owners):
            future.add_done_callback(functools.partial(_counted, count, group))
        for group, request in enumerate(prepared):
            if not request.prompts:
                finished.put(group)
        for _ in prepared:
            group = finished.get()
            served = [f.result() for f in by_group[group]]  # a failed request raises here, naming the engine
            completions = [_completion(s) for s in served]
            yield (
                group,
                self._packed(prepared[group], completions, [s.versions for s in served], (started, time.time())),
            )

    def _engine_loop(self) -> EngineLoop:
        """The engine loop; at tensor_parallel_size > 1 tensor-parallel rank 0's leads the others'
        (:mod:`rl_vllm.lockstep`), which are named by their rank in errors."""
        lockstep, name = None, f"engine {self.place.engine}"
        if self.place.tp_size > 1:
            from rl_vllm.lockstep import Lockstep

            lockstep = Lockstep.of_engine(self.place.tp_rank, self.place.tp_size)
            if self.place.tp_rank:
                name += f" (tensor-parallel rank {self.place.tp_rank})"
        engine = self.llm.llm_engine
        return EngineLoop(engine, name, self._serving_state, sampled_logprobs, lockstep, progress_reader(engine))

    def _serving_state(self) -> tuple[int, Any]:
        """The weight version and adapter a request admitted now runs with (asked by the engine loop)."""
        return self.weight_version, self._lora_request

    def _generate_batch(self, requests: list[Any], params: list[Any]) -> tuple[list[Completion], list[list[int]]]:
        """One blocking ``llm.generate``: a sync actor runs one call at a time, so a refit never lands inside it
        and every token carries the one version."""
        results = (
            self.llm.generate(requests, params, use_tqdm=False, lora_request=self._lora_request) if requests else []
        )
        completions = []
        for request, result in zip(requests, results):
            out = result.outputs[0]
            tokens = list(out.token_ids)
            prompt = list(result.prompt_token_ids or []) if "multi_modal_data" in request else None
            completions.append(Completion(tokens, sampled_logprobs(tokens, out.logprobs), out.finish_reason, prompt))
        return completions, [[self.weight_version] * len(c.token_ids) for c in completions]

    def _serve(
        self, prompts: Sequence[Prompt], params: list[Any], call_id: str | None = None
    ) -> tuple[list[Completion], list[list[int]]]:
        """Submit to the engine loop and wait: the requests join the running batch; each token carries the
        version of the weights of the step that sampled it. A failed loop raises here, naming the engine.
        ``call_id`` (the facade's, the same on every rank of the engine) keys row ``i`` as ``call_id:i``: the
        leading rank's ticks admit requests by key (tensor_parallel_size > 1)."""
        assert self._loop is not None
        output_kind = _output_kind(self._loop)
        futures = []
        for row, (prompt, param) in enumerate(zip(prompts, params)):
            param.output_kind = output_kind
            futures.append(self._loop.submit(prompt, param, None if call_id is None else f"{call_id}:{row}"))
        served = [f.result() for f in futures]
        return [_completion(s) for s in served], [s.versions for s in served]

    # -- the engine lifecycle (vllm_cfg.async_engine) ---------------------------------------
    def pause_generation(self, mode: Literal["abort", "wait", "keep"] = "wait", timeout_s: float | None = None) -> str:
        """Stop the engine between two steps (``GenerationInterface.pause_generation``); returns the state."""
        loop = self._require_loop("pause_generation")
        loop.pause(mode, timeout_s)
        return loop.state

    def resume_generation(self, recompute_kv_cache: bool = False) -> str:
        """Serve again (``GenerationInterface.resume_generation``); returns the state."""
        loop = self._require_loop("resume_generation")
        loop.resume(recompute_kv_cache)
        return loop.state

    def serving_state(self) -> dict[str, Any]:
        """The loop's state, its step count, its requests (running + queued), the tokens each running one has
        generated so far, and whether requests ask for their final output only: for tests and logs."""
        loop = self._require_loop("serving_state")
        return {
            "state": loop.state,
            "steps": loop.steps,
            "requests": loop.running(),
            "tokens_so_far": loop.tokens_so_far(),
            "final_only": loop.final_only,
        }

    def _require_loop(self, method: str) -> EngineLoop:
        if self._loop is None:
            raise RuntimeError(
                f"engine {self.rank}: {method} needs policy.generation.vllm_cfg.async_engine: true (this engine runs "
                "one blocking llm.generate per batch; there is nothing to pause)"
            )
        return self._loop

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        """Hold the engine for a refit (:meth:`rl_vllm.engine_loop.EngineLoop.held`: parked, pausing in ``wait``
        mode first and resuming after when the caller did not pause, a safety net for sync GRPO). Without the
        engine loop, the actor runs one call at a time already."""
        if self._loop is None:
            yield
            return
        with self._loop.held():
            yield


def _output_kind(loop: EngineLoop) -> Any:
    """The ``RequestOutputKind`` ``loop``'s requests ask for (see ``EngineLoop.final_only``)."""
    from vllm.sampling_params import RequestOutputKind

    return RequestOutputKind.FINAL_ONLY if loop.final_only else RequestOutputKind.DELTA


def _completion(served: Served) -> Completion:
    return Completion(served.token_ids, served.logprobs, served.finish_reason, served.prompt_token_ids)


def _counted(count: Callable[[int], None], group: int, _future: Future[Any]) -> None:
    count(group)


def token_versions(input_lengths: Any, versions: list[list[int]], width: int, current: int) -> dict[str, Any]:
    """``generation_weight_versions`` (``[B, width]`` int64: each generated token's weight version, -1 at prompt
    and padding) and ``weight_version`` (``[B]``: the oldest version among the sample's tokens; ``current`` for a
    sample with none)."""
    import torch

    per_token = torch.full((len(versions), width), -1, dtype=torch.long)
    for i, own in enumerate(versions):
        start = int(input_lengths[i])
        if own:
            per_token[i, start : start + len(own)] = torch.tensor(own, dtype=torch.long)
    oldest = torch.tensor([min(own) if own else current for own in versions], dtype=torch.long)
    return {"generation_weight_versions": per_token, "weight_version": oldest}
