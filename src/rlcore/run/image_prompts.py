"""The prompts of a vision-language run, in the batch form of docs/vision.md.

A run's model is a vision-language one when its Hugging Face config has a ``vision_config``; its prompts are
then rendered with the run's tokenizer (the same chat template and tools as a text run's), and each image
placeholder expanded to the image's tokens by the model's image processor, which also gives the pixels. Every
row of such a run carries ``pixel_values`` / ``image_grid_thw`` (empty for a row without images) and, for the
engine, ``images``. torch and transformers are imported inside the functions.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from PIL.Image import Image

    from rlcore.data import BatchedDataDict
    from rlcore.datasets import Sample

#: Token ids and their loss mask: one message of an SFT sample.
Chunk = tuple[list[int], list[int]]

#: The keys an image row adds to a generation request; the trainer gets all but ``images``.
IMAGE_KEYS = ("pixel_values", "image_grid_thw", "images")
TRAINED_IMAGE_KEYS = ("pixel_values", "image_grid_thw")


@dataclass(frozen=True)
class ImageModel:
    """What the driver needs of a vision-language model to make its prompts."""

    image_processor: Any
    image_token_id: int
    #: the ids that stand for an image's (or a video's) place; a completion is cut before one (a forward would
    #: look for pixels for it)
    placeholder_ids: frozenset[int] = frozenset()

    @property
    def patch_features(self) -> int:
        """The width of one row of ``pixel_values``: a patch's channels x time x height x width."""
        p = self.image_processor
        return 3 * p.temporal_patch_size * p.patch_size**2

    def no_pixels(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``pixel_values`` and ``image_grid_thw`` of a row without images."""
        import torch

        return torch.zeros(0, self.patch_features), torch.zeros(0, 3, dtype=torch.long)


@functools.lru_cache(maxsize=4)
def image_model_at(path: str, processor_path: str | None = None) -> ImageModel | None:
    """The image side of the model at ``path`` (a directory or a hub id in the cache), or None for a text model
    (also for a directory without a model config: only a model's config can say it sees images). The image
    processor's files are read from ``processor_path`` when it has them (a run's tokenizer directory), else
    from ``path``."""
    from transformers import AutoConfig, AutoImageProcessor

    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError):  # no config.json there
        return None
    if getattr(config, "vision_config", None) is None:
        return None
    placeholders = {int(config.image_token_id)}
    if getattr(config, "video_token_id", None) is not None:
        placeholders.add(int(config.video_token_id))
    try:
        processor = AutoImageProcessor.from_pretrained(processor_path or path)
    except OSError:  # a tokenizer's directory without the processor's files
        processor = AutoImageProcessor.from_pretrained(path)
    return ImageModel(processor, int(config.image_token_id), frozenset(placeholders))


def image_model_of(cfg: Any) -> ImageModel | None:
    """The run's image model: ``policy.model_name``'s config says whether it sees images; the processor's files
    come from the tokenizer's directory, else the model's. None for a text run."""
    policy = cfg.policy
    model = getattr(policy, "model_name", None)
    tokenizer = getattr(getattr(policy, "tokenizer", None), "name", None)
    if not model:  # a stand-in config without a model: its tokenizer's directory
        model, tokenizer = tokenizer, None
    return image_model_at(str(model), str(tokenizer) if tokenizer else None) if model else None


def image_prompt_length(cfg: Any, tokenizer: Any, image_model: ImageModel) -> Callable[[Sample], int]:
    """``sample -> its prompt's token count`` with each image's tokens expanded (to check data before a run)."""
    return lambda sample: len(_prompt(cfg, tokenizer, image_model, sample, None)[0])


def encode_image_samples(
    cfg: Any,
    tokenizer: Any,
    image_model: ImageModel,
    samples: list[Sample],
    repeat: int,
    tools: list[dict[str, Any]] | None = None,
) -> BatchedDataDict[Any]:
    """The samples' prompts, each ``repeat`` times: expanded ``input_ids``, ``input_lengths``, ``prompt_cut``
    (all false: an image prompt is not cut) and the image keys. Copies of a sample share its pixels."""
    import torch

    from rlcore.data import BatchedDataDict
    from rlcore.run.prompts import pad_id

    prompts = [_prompt(cfg, tokenizer, image_model, s, tools) for s in samples]
    max_input = getattr(getattr(cfg, "data", None), "max_input_seq_length", None)
    for sample, (ids, _, _) in zip(samples, prompts):
        if max_input is not None and len(ids) >= max_input:
            raise ValueError(
                f"data row {sample.idx}: its prompt with images is {len(ids)} tokens, and "
                f"data.max_input_seq_length is {max_input}: a prompt with images is not cut (its image tokens "
                "would no longer match its pixels); raise data.max_input_seq_length or use smaller images"
            )
    width, pad = max(len(ids) for ids, _, _ in prompts), pad_id(tokenizer)
    rows = [i for i in range(len(samples)) for _ in range(repeat)]
    batch: BatchedDataDict[Any] = BatchedDataDict(
        input_ids=torch.tensor([prompts[i][0] + [pad] * (width - len(prompts[i][0])) for i in rows]),
        input_lengths=torch.tensor([len(prompts[i][0]) for i in rows], dtype=torch.long),
        prompt_cut=torch.zeros(len(rows), dtype=torch.bool),
    )
    batch["pixel_values"] = [prompts[i][1] for i in rows]
    batch["image_grid_thw"] = [prompts[i][2] for i in rows]
    batch["images"] = [list(samples[i].images) for i in rows]
    return batch


@contextlib.contextmanager
def rendering_images() -> Iterator[None]:
    """A chat template that fails on a message with image parts (``content.strip()`` on a list) is one line
    naming the setting, not a Jinja traceback."""
    from jinja2 import TemplateError

    from rlcore.datasets.files import DataError

    try:
        yield
    except (TemplateError, TypeError, AttributeError) as exc:
        raise DataError(
            f"policy.tokenizer.chat_template: cannot render a message with image parts ({exc}); set it to "
            "'default' (the model's own template) or to a template that renders {'type': 'image'} parts"
        ) from None


def _prompt(
    cfg: Any, tokenizer: Any, image_model: ImageModel, sample: Sample, tools: list[dict[str, Any]] | None
) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """One sample's expanded prompt ids, pixels and grids, rendered as a text run renders its prompts."""
    from rlcore.chat.templates import encode_rendered
    from rlcore.chat.vision import check_image_parts, expanded_prompt
    from rlcore.run.prompts import render_prompts

    with rendering_images():
        text = render_prompts(tokenizer, [sample.messages], cfg.policy.tokenizer.chat_template_kwargs, tools)[0]
    ids = encode_rendered(tokenizer, text)
    if not sample.images:
        check_image_parts(ids.count(image_model.image_token_id), 0, sample.idx)  # a placeholder with no image
        return (ids, *image_model.no_pixels())
    prompt = expanded_prompt(
        ids, sample.images, image_model.image_processor, image_model.image_token_id, row=sample.idx
    )
    return prompt.ids, prompt.pixel_values, prompt.image_grid_thw


def expand_image_chunks(
    chunks: list[Chunk], images: list[Image], image_model: ImageModel
) -> tuple[list[Chunk], torch.Tensor, torch.Tensor]:
    """A message log's ``(ids, mask)`` chunks with each image token expanded to its image's tokens (each copy
    masked as the token was), and the images' ``pixel_values`` and ``image_grid_thw``."""
    from rlcore.chat.vision import check_image_parts, image_token_counts

    token = image_model.image_token_id
    check_image_parts(sum(ids.count(token) for ids, _ in chunks), len(images))
    if not images:
        return chunks, *image_model.no_pixels()
    vision = image_model.image_processor(images=list(images), return_tensors="pt")
    counts = iter(image_token_counts(vision["image_grid_thw"], image_model.image_processor.merge_size))
    expanded = []
    for ids, mask in chunks:
        new_ids: list[int] = []
        new_mask: list[int] = []
        for t, m in zip(ids, mask):
            n = next(counts) if t == token else 1
            new_ids += [t] * n
            new_mask += [m] * n
        expanded.append((new_ids, new_mask))
    return expanded, vision["pixel_values"], vision["image_grid_thw"]
