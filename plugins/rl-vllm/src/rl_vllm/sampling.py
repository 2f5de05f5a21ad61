"""Engine-independent pieces of ``generate``: sampling options in, padded tensors out.

Kept apart from the worker so that they can be tested without an engine and
read without knowing vLLM. torch is imported inside the functions that need it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

#: The ``GenerationConfig`` fields that shape one ``generate`` call.
SAMPLING_FIELDS = ("max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "stop_strings", "pad_token_id")


def sampling_options(generation_config: Any) -> dict[str, Any]:
    """The sampling fields of a ``GenerationConfig`` as a plain dict (sent with every call)."""
    return {name: getattr(generation_config, name) for name in SAMPLING_FIELDS}


def request_stop_strings(
    global_stops: Sequence[str] | None, per_sample: Sequence[Sequence[str] | None] | None, batch: int
) -> list[list[str]]:
    """Stop strings of each request: the config's plus the sample's own, deduplicated, in order."""
    if per_sample is not None and len(per_sample) != batch:
        raise ValueError(f"stop_strings has {len(per_sample)} entries for a batch of {batch}")
    out = []
    for i in range(batch):
        own = per_sample[i] if per_sample is not None else None
        if isinstance(own, str):  # a lone string is one stop string, not its characters
            own = [own]
        merged = list(dict.fromkeys([*(global_stops or []), *(own or [])]))
        out.append([s for s in merged if s])
    return out


def request_seeds(data: Any, batch: int) -> list[int | None]:
    """Each request's sampling seed: ``data["sampling_seeds"]`` (``[B]`` int64, design.md §2.1), or None for
    every request of a batch without the key (the engine's own random state then draws, as before). A seeded
    request samples from a generator of its own (``SamplingParams(seed=...)``): the same request on the same
    weights gives the same completion, whatever the engine sampled before it."""
    seeds = data.get("sampling_seeds") if hasattr(data, "get") else None
    if seeds is None:
        return [None] * batch
    values: list[int | None] = [int(s) for s in (seeds.tolist() if hasattr(seeds, "tolist") else seeds)]
    if len(values) != batch:
        raise ValueError(f"sampling_seeds has {len(values)} entries for a batch of {batch}")
    return values


@dataclass
class Completion:
    """What the engine produced for one prompt."""

    token_ids: list[int]
    logprobs: list[float]  # one per generated token, under the sampling distribution
    finish_reason: str | None  # "stop" (EOS, stop token or stop string), "length", ...
    prompt_token_ids: list[int] | None = None  # vLLM's prompt, kept for a request with images (it expands them)


def sampled_logprobs(token_ids: Sequence[int], logprobs: Any) -> list[float]:
    """The logprob of each sampled token, from a vLLM completion's ``logprobs``.

    ``logprobs`` is vLLM's ``FlatLogprobs`` (``SamplingParams(flat_logprobs=True)``:
    flat lists, no dict and ``Logprob`` object per token) or its list of
    ``{token_id: Logprob}`` dicts. vLLM's sampler puts the sampled token's entry
    first at each position; it is checked against the token id (and looked up
    by id if not first). With ``logprobs=0`` there is exactly one entry per
    position and the flat lists are used as they are. Stops at the shorter of
    the two; the caller checks the count.
    """
    if not logprobs:
        return []
    starts = getattr(logprobs, "start_indices", None)
    if starts is None:  # list of {token_id: Logprob} per position
        return [float(step[tok].logprob) for tok, step in zip(token_ids, logprobs)]
    ids, values, ends = logprobs.token_ids, logprobs.logprobs, logprobs.end_indices
    if len(values) == len(starts) == len(token_ids) and ids == list(token_ids):
        return [float(v) for v in values]  # one entry per position, the sampled token's
    out = []
    for i, tok in enumerate(token_ids[: len(starts)]):
        j = next((k for k in range(starts[i], ends[i]) if ids[k] == tok), None)
        if j is None:
            raise ValueError(f"the engine returned no logprob for the sampled token {tok} at position {i}")
        out.append(float(values[j]))
    return out


def batch_problems(data: Any, max_model_len: int | None = None) -> list[str]:
    """What is wrong with a generation batch, checked before it reaches an engine (empty when fine).

    Checked on the driver because an exception inside an engine actor makes
    the worker group unusable: bad input must never cost the engines.
    """
    if "input_ids" not in data or "input_lengths" not in data:
        return [f"generate needs 'input_ids' and 'input_lengths'; got keys {sorted(data.keys())}"]
    ids, lengths = data["input_ids"], data["input_lengths"]
    if ids.dim() != 2:
        return [f"input_ids must be [B, S], got shape {tuple(ids.shape)}"]
    if tuple(lengths.shape) != (ids.shape[0],):
        return [f"input_lengths must be [{ids.shape[0]}], got shape {tuple(lengths.shape)}"]
    problems = []
    bad = [(i, int(n)) for i, n in enumerate(lengths.tolist()) if not 0 < n <= ids.shape[1]]
    if bad:
        problems.append(f"input_lengths must be in [1, {ids.shape[1]}]; got (row, length) {bad[:5]}")
    if max_model_len is not None:
        long = [(i, int(n)) for i, n in enumerate(lengths.tolist()) if n >= max_model_len]
        if long:
            problems.append(
                f"prompts leave no room to generate within max_model_len={max_model_len} "
                f"(policy.generation.vllm_cfg.max_model_len); (row, length) {long[:5]}"
            )
    stops = data.get("stop_strings")
    if stops is not None and len(stops) != ids.shape[0]:
        problems.append(f"stop_strings has {len(stops)} entries for a batch of {ids.shape[0]}")
    seeds = data.get("sampling_seeds")
    if seeds is not None and len(seeds) != ids.shape[0]:
        problems.append(f"sampling_seeds has {len(seeds)} entries for a batch of {ids.shape[0]}")
    return problems


def prompts_from_batch(input_ids: Any, input_lengths: Any) -> list[list[int]]:
    """Unpadded token lists of a right-padded ``[B, S]`` batch; every prompt must be non-empty."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, S], got shape {tuple(input_ids.shape)}")
    lengths = [int(n) for n in input_lengths.tolist()]
    if len(lengths) != input_ids.shape[0]:
        raise ValueError(f"input_lengths has {len(lengths)} entries for {input_ids.shape[0]} prompts")
    bad = [(i, n) for i, n in enumerate(lengths) if not 0 < n <= input_ids.shape[1]]
    if bad:
        raise ValueError(f"input_lengths must be in [1, {input_ids.shape[1]}]; got (row, length) {bad[:5]}")
    return [input_ids[i, :n].tolist() for i, n in enumerate(lengths)]


def pack_outputs(
    input_ids: Any, input_lengths: Any, completions: Sequence[Completion], max_new_tokens: int, pad_token_id: int
) -> dict[str, Any]:
    """Right-padded ``GenerationOutputSpec`` tensors from per-prompt completions.

    ``output_ids`` is ``[B, S + max_new_tokens]``: the prompt, its generated
    tokens, then ``pad_token_id``. ``logprobs`` has the same shape, float32:
    0 on prompt and padding positions, and at the index of each generated
    token its logprob (design.md §2.2: the same index the policy's
    ``get_logprobs`` uses for that token).
    """
    import torch

    batch, width = input_ids.shape
    out_width = width + max_new_tokens
    output_ids = torch.full((batch, out_width), pad_token_id, dtype=torch.long)
    logprobs = torch.zeros((batch, out_width), dtype=torch.float32)
    gen_lengths = torch.zeros(batch, dtype=torch.long)
    truncated = torch.zeros(batch, dtype=torch.bool)
    for i, done in enumerate(completions):
        n_prompt = int(input_lengths[i])
        n_gen = len(done.token_ids)
        if n_gen > max_new_tokens:
            raise ValueError(f"sample {i}: engine returned {n_gen} tokens, more than max_new_tokens={max_new_tokens}")
        if len(done.logprobs) != n_gen:
            raise ValueError(f"sample {i}: {len(done.logprobs)} logprobs for {n_gen} tokens")
        output_ids[i, :n_prompt] = input_ids[i, :n_prompt]
        if n_gen:
            output_ids[i, n_prompt : n_prompt + n_gen] = torch.tensor(done.token_ids, dtype=torch.long)
            logprobs[i, n_prompt : n_prompt + n_gen] = torch.tensor(done.logprobs, dtype=torch.float32)
        gen_lengths[i] = n_gen
        truncated[i] = done.finish_reason == "length"
    return {
        "output_ids": output_ids,
        "logprobs": logprobs,
        "generation_lengths": gen_lengths,
        "unpadded_sequence_lengths": input_lengths.long().cpu() + gen_lengths,
        "truncated": truncated,
    }
