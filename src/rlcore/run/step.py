"""The pieces of a step every rollout loop shares (GRPO, on-policy distillation, a third party's): prompts,
refit, the training batch, memory metrics (the rollout itself: :mod:`rlcore.run.rollouts`; GRPO's advantages,
loss inputs and training call: :mod:`rlcore.algorithms.grpo.step`)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlcore.datasets import Sample


@dataclass
class Timer:
    """Wall-clock seconds per phase of one step."""

    seconds: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[f"time/{name}_s"] = self.seconds.get(f"time/{name}_s", 0.0) + time.perf_counter() - start


def loop_setting(cfg: Any, name: str, default: Any) -> Any:
    """The algorithm section's ``name``, one of the settings rlcore's rollout loops share
    (:class:`rlcore.config.rollout_loop.RolloutLoopConfig`: ``max_rollout_turns``, ``val_period``, ``val_at_start``,
    ``val_at_end``, ``val_batch_size``, ``seed``), or ``default`` for a section that does not declare it (a third
    party's config class owes rlcore nothing: without ``val_period`` it is simply never validated periodically)."""
    return getattr(cfg.algorithm_section, name, default)


def prompt_ids(tokenizer: Any, text: str) -> list[int]:
    """The token ids of a rendered prompt, starting with the tokenizer's BOS (once: a chat template may have
    written it); :func:`rlcore.chat.templates.encode_rendered`."""
    from rlcore.chat.templates import encode_rendered

    return encode_rendered(tokenizer, text)


def prompt_length_of(cfg: Any, tokenizer: Any, tools: list[dict[str, Any]] | None = None) -> Any:
    """``sample -> its prompt's token count`` under the run's chat template, with the environment's ``tools``
    when it has some (to check data before a run)."""
    from rlcore.run.image_prompts import image_model_of, image_prompt_length
    from rlcore.run.prompts import render_prompts

    if (image_model := image_model_of(cfg)) is not None:
        return image_prompt_length(cfg, tokenizer, image_model)
    kwargs = cfg.policy.tokenizer.chat_template_kwargs
    return lambda sample: len(prompt_ids(tokenizer, render_prompts(tokenizer, [sample.messages], kwargs, tools)[0]))


def encode_prompts(tokenizer: Any, prompts: list[str], repeat: int, max_input: int | None = None) -> Any:
    """Right-padded ``input_ids`` / ``input_lengths`` with every prompt repeated ``repeat`` times, and
    ``prompt_cut``: the prompts of at least ``max_input`` tokens (``data.max_input_seq_length``), cut
    (:func:`rlcore.run.prompts.cut_long_prompts`)."""
    import torch

    from rlcore.data import BatchedDataDict
    from rlcore.run.prompts import cut_long_prompts, pad_id

    ids, cut = cut_long_prompts([prompt_ids(tokenizer, p) for p in prompts], max_input)
    width = max(len(seq) for seq in ids)
    pad = pad_id(tokenizer)
    input_ids = torch.tensor([seq + [pad] * (width - len(seq)) for seq in ids], dtype=torch.long)
    lengths = torch.tensor([len(seq) for seq in ids], dtype=torch.long)
    cut_mask = torch.tensor(cut, dtype=torch.bool)
    batch: BatchedDataDict[Any] = BatchedDataDict(input_ids=input_ids, input_lengths=lengths, prompt_cut=cut_mask)
    return batch.repeat_interleave(repeat)


def training_batch(rollout: Any, advantages: Any) -> Any:
    """The policy's training data: the generated tokens (``token_mask``) are the trained ones, each carrying its
    sample's advantage; a sample whose prompt was cut at ``data.max_input_seq_length`` (``prompt_cut``) has
    ``sample_mask`` 0, NeMo-RL's ``loss_multiplier``."""
    import torch

    from rlcore.data import BatchedDataDict
    from rlcore.run.image_prompts import TRAINED_IMAGE_KEYS

    token_mask = rollout["token_mask"]
    cut = rollout.get("prompt_cut")
    images = {key: rollout[key] for key in TRAINED_IMAGE_KEYS if key in rollout}
    return BatchedDataDict(
        input_ids=rollout["output_ids"],
        input_lengths=rollout["unpadded_sequence_lengths"],
        token_mask=token_mask,
        sample_mask=torch.ones(token_mask.shape[0]) if cut is None else (~cut).float(),
        advantages=advantages[:, None] * token_mask,
        generation_logprobs=rollout["logprobs"].float(),
        **images,
    )


def peak_memory_metrics(policy: Any, generation: Any, **others: Any) -> dict[str, float]:
    """Peak resident memory so far (GiB, the largest rank) of the training workers and, when they are
    other processes, the generation engines; plus GPU peaks where the workers use a GPU. ``others``: more worker
    groups' owners by role (``value=`` a critic), reported as ``memory/<role>_peak_rss_gib``."""
    metrics: dict[str, float] = {}
    for role, owner in (("train", policy), ("generation", generation), *others.items()):
        group = getattr(owner, "worker_group", None)
        if group is None or (role == "generation" and owner is policy):
            continue
        peaks = group.peak_memory()
        metrics[f"memory/{role}_peak_rss_gib"] = max(p["rss"] for p in peaks) / 2**30
        if any("device" in p for p in peaks):
            metrics[f"memory/{role}_peak_device_gib"] = max(p.get("device", 0) for p in peaks) / 2**30
    return metrics


def encode_samples(
    cfg: Any, tokenizer: Any, samples: list[Sample], repeat: int, tools: list[dict[str, Any]] | None = None
) -> Any:
    """The samples' message logs through the chat template, encoded (those of ``data.max_input_seq_length``
    tokens or more cut, ``prompt_cut``), each ``repeat`` times. ``tools``: the environment's tool schemas (OpenAI
    function tools), given to the template as ``apply_chat_template(tools=...)``."""
    from rlcore.run.image_prompts import encode_image_samples, image_model_of
    from rlcore.run.prompts import check_prompt_room, render_prompts

    if (image_model := image_model_of(cfg)) is not None:  # a vision-language run: docs/vision.md
        batch = encode_image_samples(cfg, tokenizer, image_model, samples, repeat, tools)
    else:
        kwargs = cfg.policy.tokenizer.chat_template_kwargs
        texts = render_prompts(tokenizer, [s.messages for s in samples], kwargs, tools=tools)
        batch = encode_prompts(tokenizer, texts, repeat, max_input_of(cfg))
    check_prompt_room(batch["input_lengths"], cfg.policy.max_total_sequence_length)
    return batch


def max_input_of(cfg: Any) -> int | None:
    """``data.max_input_seq_length``, or None for a config without one (a stand-in of a test, a third party's)."""
    return getattr(getattr(cfg, "data", None), "max_input_seq_length", None)


def refit(policy: Any, synchronizer: Any) -> float:
    """Move the policy's weights into the engines; returns the bytes moved."""
    policy.offload_before_refit()
    moved = synchronizer.sync_weights()["bytes"]
    policy.offload_after_refit()
    return moved
