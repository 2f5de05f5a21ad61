"""Hugging Face ``generate`` behind rlcore's generation contract (``GenerationOutputSpec``).

rlcore batches are right-padded; HF decoder-only generation needs left
padding (new tokens are appended at the same column for every row). This
module converts in both directions, applies the sampling settings of
``policy.generation``, stops rows on stop token ids and on stop strings
(global and per sample, which HF's own ``stop_strings`` cannot do), and
computes the logprobs with the policy's alignment (design.md §2.2).

Logprob semantics: sampling uses ``log_softmax(logits / temperature)``
(before top-k/top-p truncation, which only restricts the support); greedy
decoding reports ``log_softmax(logits)``, the same numbers ``get_logprobs``
gives for the produced sequence (greedy is temperature 0, which scales
nothing, as in vLLM).

Where a stop string ends a row, the row keeps the tokens up to and including
the one that completed the string (tokens are not split); a stop token id is
kept as the last generated token.

A batch with ``sampling_seeds`` (``[B]`` int64, design.md §2.1) samples each
row from a ``torch.Generator`` of its own, seeded with the row's seed
(:class:`SeededRowSampler`), so a row's completion depends on its seed and
the weights, not on what was sampled before it (a resumed run reproduces it).
Without the key, rows draw from torch's global generator, as HF does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class SamplingSettings:
    """What one ``generate`` call does; built from ``policy.generation`` and the ``greedy`` flag."""

    max_new_tokens: int
    greedy: bool
    temperature: float
    top_p: float
    top_k: int | None
    stop_token_ids: tuple[int, ...]
    pad_token_id: int

    @classmethod
    def from_config(cls, gen_cfg: Any, tokenizer: Any, greedy: bool) -> SamplingSettings:
        eos = getattr(tokenizer, "eos_token_id", None)
        stop_ids = set(gen_cfg.stop_token_ids or ())
        if eos is not None:
            stop_ids.add(int(eos))
        pad = gen_cfg.pad_token_id
        if pad is None:
            pad = getattr(tokenizer, "pad_token_id", None)
        if pad is None:
            pad = eos if eos is not None else 0
        return cls(
            max_new_tokens=int(gen_cfg.max_new_tokens),
            greedy=bool(greedy) or gen_cfg.temperature == 0,
            temperature=float(gen_cfg.temperature),
            top_p=float(gen_cfg.top_p),
            top_k=gen_cfg.top_k,
            stop_token_ids=tuple(sorted(stop_ids)),
            pad_token_id=int(pad),
        )

    @property
    def logprob_temperature(self) -> float:
        return 1.0 if self.greedy else self.temperature

    def hf_generation_config(self, seeded: bool = False) -> Any:
        """A complete ``transformers.GenerationConfig`` (nothing inherited from the model's defaults, e.g. top_k=50).
        ``seeded``: a :class:`SeededRowSampler` picks the tokens; HF takes them (the argmax of one finite score)."""
        from transformers import GenerationConfig

        sampling = {} if self.greedy else dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k or 0)
        if seeded:
            sampling = {}
        return GenerationConfig(
            max_new_tokens=self.max_new_tokens,
            do_sample=not self.greedy and not seeded,
            eos_token_id=list(self.stop_token_ids) or None,
            pad_token_id=self.pad_token_id,
            return_dict_in_generate=True,
            output_logits=True,
            use_cache=True,
            **sampling,
        )


def row_stop_strings(data: Any, global_stops: Sequence[str] | None) -> list[list[str]]:
    """Per-row stop strings: the global ones plus the row's ``data["stop_strings"][i]`` (if any)."""
    rows = data["input_ids"].shape[0]
    per_sample = data.get("stop_strings") if hasattr(data, "get") else None
    out = []
    for i in range(rows):
        extra = per_sample[i] if per_sample is not None and per_sample[i] else []
        out.append(sorted(set(global_stops or ()) | set(extra)))
    return out


class StopStringFinder:
    """Finds where a row's generated tokens first complete one of its stop strings.

    Only a window of the last tokens is decoded at each position: a stop
    string of ``c`` characters spans at most ``c`` tokens (each token decodes
    to at least one character), plus slack for tokens that decode to nothing
    on their own (partial UTF-8 bytes).
    """

    def __init__(self, tokenizer: Any, stops: list[list[str]]) -> None:
        self.tokenizer = tokenizer
        self.stops = stops
        longest = max((len(s) for row in stops for s in row), default=0)
        self.window = longest + 8

    def hit(self, row: int, tokens: Sequence[int]) -> bool:
        """Whether ``tokens`` (generated so far) end with a completed stop string of ``row``."""
        if not self.stops[row] or not tokens:
            return False
        text = self.tokenizer.decode(list(tokens[-self.window :]), skip_special_tokens=False)
        return any(s in text for s in self.stops[row])

    def first_hit(self, row: int, tokens: Sequence[int]) -> int | None:
        """Number of tokens up to and including the one completing the first stop string, or None."""
        if not self.stops[row]:
            return None
        for k in range(1, len(tokens) + 1):
            if self.hit(row, tokens[:k]):
                return k
        return None


def stopping_criteria(finder: StopStringFinder, prompt_width: int) -> Any:
    """An HF ``StoppingCriteria`` ending each row (not the batch) at its first stop string."""
    from transformers import StoppingCriteria

    class _PerRowStopStrings(StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
            generated = input_ids[:, prompt_width:].tolist()
            done = [finder.hit(i, row) for i, row in enumerate(generated)]
            return torch.tensor(done, dtype=torch.bool, device=input_ids.device)

    return _PerRowStopStrings()


class SeededRowSampler:
    """An HF logits processor that samples each row's next token with the row's own generator.

    It applies what HF's sampling would (temperature, then top-k, then top-p, HF's own warpers), draws one token
    per row from ``softmax`` with that row's ``torch.Generator``, and returns scores that are ``-inf`` except at
    the drawn token, which HF's greedy selection then takes. HF reports the raw logits (``output_logits``), so
    the logprobs are those of the unchanged distribution.
    """

    def __init__(self, settings: SamplingSettings, seeds: Sequence[int], device: torch.device) -> None:
        from transformers.generation.logits_process import (
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )

        self.warpers: list[Any] = []
        if settings.temperature != 1.0:
            self.warpers.append(TemperatureLogitsWarper(settings.temperature))
        if settings.top_k:
            self.warpers.append(TopKLogitsWarper(top_k=settings.top_k))
        if settings.top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(top_p=settings.top_p))
        self.generators = [torch.Generator(device=device).manual_seed(int(seed)) for seed in seeds]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for warper in self.warpers:
            scores = warper(input_ids, scores)
        probs = torch.softmax(scores.float(), dim=-1)
        drawn = [torch.multinomial(probs[i], 1, generator=g) for i, g in enumerate(self.generators)]
        chosen = torch.cat(drawn)
        picked = torch.full_like(scores, float("-inf"))
        picked[torch.arange(scores.shape[0], device=scores.device), chosen] = 0.0
        return picked


def row_seeds(data: Any) -> list[int] | None:
    """``data["sampling_seeds"]`` as ints (None when the batch has none); one per row or an error."""
    seeds = data.get("sampling_seeds") if hasattr(data, "get") else None
    if seeds is None:
        return None
    values = [int(s) for s in (seeds.tolist() if hasattr(seeds, "tolist") else seeds)]
    rows = data["input_ids"].shape[0]
    if len(values) != rows:
        raise ValueError(f"sampling_seeds has {len(values)} entries for a batch of {rows}")
    return values


def left_pad(input_ids: torch.Tensor, input_lengths: torch.Tensor, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded prompts → left-padded ``[B, max_len]`` prompts and their attention mask."""
    width = int(input_lengths.max())
    batch = input_ids.shape[0]
    ids = torch.full((batch, width), pad_id, dtype=input_ids.dtype)
    mask = torch.zeros((batch, width), dtype=torch.long)
    for i, length in enumerate(input_lengths.tolist()):
        ids[i, width - length :] = input_ids[i, :length]
        mask[i, width - length :] = 1
    return ids, mask


def vision_inputs(model: Any, data: Any, left_ids: torch.Tensor) -> dict[str, Any]:
    """A vision-language model's image kwargs for ``generate`` (docs/vision.md): the rows' pixels and grids, and
    ``mm_token_type_ids`` of the left-padded prompts, from which HF derives the 3D rotary positions. Prompts are
    in the expanded frame (one image token per merged patch), so ``output_ids`` are too."""
    from rlcore.training.vision import image_inputs, is_vision_language

    config: Any = getattr(model, "config", None)
    if config is None or not is_vision_language(config):
        return {}
    return image_inputs(data, left_ids, int(config.image_token_id))


def generate(
    model: Any,
    data: Any,
    settings: SamplingSettings,
    tokenizer: Any,
    stop_strings: Sequence[str] | None,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """Run HF ``generate`` on ``model`` (a plain, full-parameter HF model) and build the output spec."""
    from transformers import LogitsProcessorList, StoppingCriteriaList

    input_ids, input_lengths = data["input_ids"], data["input_lengths"].long()
    batch, prompt_width = input_ids.shape
    left_ids, mask = left_pad(input_ids, input_lengths, settings.pad_token_id)
    finder = StopStringFinder(tokenizer, row_stop_strings(data, stop_strings))
    criteria = StoppingCriteriaList()
    if any(finder.stops):
        criteria.append(stopping_criteria(finder, left_ids.shape[1]))
    seeds = None if settings.greedy else row_seeds(data)
    processors = LogitsProcessorList([SeededRowSampler(settings, seeds, device)] if seeds is not None else [])

    out = model.generate(
        input_ids=left_ids.to(device),
        **vision_inputs(model, data, left_ids.to(device)),
        attention_mask=mask.to(device),
        generation_config=settings.hf_generation_config(seeded=seeds is not None),
        stopping_criteria=criteria,
        logits_processor=processors,
    )
    new_tokens = out.sequences[:, left_ids.shape[1] :].cpu()
    logits = torch.stack(out.logits, dim=1).float().cpu() if out.logits else torch.zeros(batch, 0, 1)
    step_logprobs = torch.log_softmax(logits / settings.logprob_temperature, dim=-1)
    step_logprobs = step_logprobs.gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)

    width = prompt_width + settings.max_new_tokens
    output_ids = torch.full((batch, width), settings.pad_token_id, dtype=input_ids.dtype)
    logprobs = torch.zeros((batch, width), dtype=torch.float32)
    gen_lengths = torch.zeros(batch, dtype=torch.long)
    truncated = torch.zeros(batch, dtype=torch.bool)
    stop_ids = set(settings.stop_token_ids)
    for i in range(batch):
        tokens = new_tokens[i].tolist()
        n = next((k + 1 for k, t in enumerate(tokens) if t in stop_ids), len(tokens))
        by_string = finder.first_hit(i, tokens[:n])
        stopped = n < len(tokens) or (bool(tokens) and tokens[n - 1] in stop_ids)
        if by_string is not None:
            n, stopped = by_string, True
        length = int(input_lengths[i])
        output_ids[i, :length] = input_ids[i, :length]
        output_ids[i, length : length + n] = new_tokens[i, :n]
        logprobs[i, length : length + n] = step_logprobs[i, :n]
        gen_lengths[i] = n
        truncated[i] = not stopped and n == settings.max_new_tokens
    return {
        "output_ids": output_ids,
        "logprobs": logprobs,
        "generation_lengths": gen_lengths,
        "unpadded_sequence_lengths": input_lengths + gen_lengths,
        "truncated": truncated,
    }


def generate_in_batches(
    model: Any,
    data: Any,
    settings: SamplingSettings,
    tokenizer: Any,
    stop_strings: Sequence[str] | None,
    device: torch.device,
    batch_size: int | None,
) -> dict[str, torch.Tensor]:
    """:func:`generate` on consecutive slices of at most ``batch_size`` prompts
    (``policy.generation_batch_size``; None = all at once), results in order. Every slice keeps the
    batch's prompt width, so the outputs have one width and concatenate."""
    size = data.size
    if not batch_size or size <= batch_size:
        return generate(model, data, settings, tokenizer, stop_strings, device)
    parts = [
        generate(model, data.slice(a, min(a + batch_size, size)), settings, tokenizer, stop_strings, device)
        for a in range(0, size, batch_size)
    ]
    return {key: torch.cat([p[key] for p in parts]) for key in parts[0]}
