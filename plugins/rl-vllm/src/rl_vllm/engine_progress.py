"""How many tokens each request of an in-process vLLM ``LLMEngine`` has generated so far, read between two steps.

vLLM has no public call for this. Its output processor keeps every request's tokens, and reading them lets the
engine loop ask for final outputs only: one ``RequestOutput`` per request, not one per request per step, which
cuts the engine's CPU per rollout by about a tenth on a small model (``benchmarks/async_grpo.py --engine-calls``)
and still tags every token with the weights that produced it (:mod:`rl_vllm.loop_thread`). An engine that does
not keep them where this reads (another vLLM release) gets ``None``, and the loop asks for per-step outputs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any


def progress_reader(engine: Any) -> Callable[[str], int] | None:
    """``generated(request_id)``: the tokens the request (its id as given to ``add_request``) has generated so far;
    None when ``engine`` does not keep them where this reads."""
    processor = getattr(engine, "output_processor", None)
    states = getattr(processor, "request_states", None)
    internal_ids = getattr(processor, "external_req_ids", None)
    if not isinstance(states, Mapping) or not isinstance(internal_ids, Mapping):
        return None

    def generated(request_id: str) -> int:
        found = [states[i] for i in internal_ids.get(request_id, ()) if i in states]
        if not found:
            raise KeyError(f"request {request_id!r} is not running in the engine's output processor")
        return sum(state.detokenizer.num_output_tokens() for state in found)

    return generated
