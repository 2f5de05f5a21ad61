"""A prompt with images, in the two forms a vision-language run needs: the engine's and the trainer's.

The chat template writes one image placeholder per image (Qwen2.5-VL: ``<|vision_start|><|image_pad|>
<|vision_end|>``). The model's processor expands each placeholder into one token per merged patch of its image,
and computes the pixels those tokens stand for. vLLM takes the template's ids with the images and expands them
itself, so the engine gets :attr:`VisionPrompt.engine_ids`; the trainer scores the expanded sequence
(:attr:`VisionPrompt.ids`) with the same ``pixel_values``. :func:`expand_image_tokens` is the expansion as a
function of the image grids alone, so the trainer's ids follow from the engine's (and a later turn's appended
ids) without running the processor's text path again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlcore.chat.templates import encode_rendered

if TYPE_CHECKING:
    import torch
    from PIL.Image import Image


@dataclass(frozen=True)
class VisionPrompt:
    """``engine_ids``: the template's ids, one image token per image; ``ids``: each image token expanded to its
    image's tokens; ``pixel_values`` ``[patches, features]`` and ``image_grid_thw`` ``[images, 3]``: the
    processor's, for both."""

    engine_ids: list[int]
    ids: list[int]
    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor


def vision_prompt(
    processor: Any,
    messages: list[dict[str, Any]],
    images: Sequence[Image],
    chat_template_kwargs: dict[str, Any] | None = None,
) -> VisionPrompt:
    """``messages`` (image parts in the order of ``images``) with the generation prompt, in both forms."""
    text = processor.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **(chat_template_kwargs or {})
    )
    engine_ids = encode_rendered(processor.tokenizer, text)
    return expanded_prompt(engine_ids, images, processor.image_processor, processor.image_token_id)


def expanded_prompt(
    engine_ids: list[int], images: Sequence[Image], image_processor: Any, image_token: int, row: int | None = None
) -> VisionPrompt:
    """The prompt of chat-template ids ``engine_ids`` (one ``image_token`` per image) and ``images``: the
    image processor's pixels and grids, and the ids expanded to match them. ``row``: the data row, for the error
    when the counts differ."""
    check_image_parts(engine_ids.count(image_token), len(images), row)
    vision = image_processor(images=list(images), return_tensors="pt")
    grid = vision["image_grid_thw"]
    ids = expand_image_tokens(engine_ids, image_token, grid, image_processor.merge_size)
    return VisionPrompt(engine_ids, ids, vision["pixel_values"], grid)


def check_image_parts(found: int, given: int, row: int | None = None) -> None:
    """Raise unless the chat template rendered as many image placeholders (``found``) as the sample (data row
    ``row``, when known) has images (``given``)."""
    if found != given:
        where = "" if row is None else f"data row {row}: "
        raise ValueError(
            f"{where}the messages show {found} image(s) (image parts rendered by the chat template) and the sample "
            f"has {given}: give one {{'type': 'image'}} part per image"
        )


def expand_image_tokens(ids: Sequence[int], image_token: int, grid_thw: torch.Tensor, merge_size: int) -> list[int]:
    """``ids`` with the ``k``-th ``image_token`` repeated ``t * h * w / merge_size**2`` times (``grid_thw[k]``)."""
    counts = image_token_counts(grid_thw, merge_size)
    if sum(1 for i in ids if i == image_token) != len(counts):
        raise ValueError(f"{len(counts)} image grid(s) for {list(ids).count(image_token)} image token(s)")
    out: list[int] = []
    images = iter(counts)
    for token in ids:
        out.extend([token] * next(images) if token == image_token else [token])
    return out


def image_token_counts(grid_thw: torch.Tensor, merge_size: int) -> list[int]:
    """How many tokens each image of ``grid_thw`` stands for: ``t * h * w / merge_size**2``."""
    return [int(t * h * w) // merge_size**2 for t, h, w in grid_thw.tolist()]
