"""Image batches of the built-in tiny VLM (``tiny-qwen2.5-vl``) and their single-process references.

:func:`image_batch` builds a right-padded training batch in the ``image_inputs`` layout (docs/vision.md):
each row's prompt through :func:`rlcore.chat.vision.vision_prompt` (image tokens expanded, the processor's
``pixel_values`` and ``image_grid_thw``), then a short text response; a row without images gets
``[0, features]`` pixels and a ``[0, 3]`` grid. :func:`reference_logprobs` and :func:`reference_sgd_step` are
the oracle: a float64 Hugging Face forward of one row at a time, exactly its valid tokens and its images.
torch, transformers and PIL are imported inside the functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from PIL.Image import Image

    from rlcore.data import BatchedDataDict

#: Each row's images as (width, height); ``()`` is a row without an image. Sizes differ so rows get different
#: patch grids (the processor rounds each side to a multiple of 28 pixels).
DEFAULT_ROWS: tuple[tuple[tuple[int, int], ...], ...] = (
    ((56, 56),),
    (),
    ((90, 60), (56, 112)),
    ((112, 84),),
)


def draw_image(width: int, height: int, shade: int) -> Image:
    """An RGB picture: a background, a rectangle and an ellipse whose colours depend on ``shade``."""
    from PIL import Image as PILImage
    from PIL import ImageDraw

    image = PILImage.new("RGB", (width, height), (shade, 255 - shade, 90))
    pen = ImageDraw.Draw(image)
    pen.rectangle((4, 6, width // 2, height - 8), fill=(255 - shade, 30, shade))
    pen.ellipse((width // 3, 2, width - 3, height // 2), fill=(20, shade, 200))
    return image


def _messages(n_images: int, row: int) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "image"} for _ in range(n_images)]
    parts.append({"type": "text", "text": f"Describe picture {row}."})
    return [{"role": "user", "content": parts}]


def _features(processor: Any) -> int:
    ip = processor.image_processor
    return 3 * int(ip.temporal_patch_size) * int(ip.patch_size) ** 2


def _prompt(processor: Any, row: int, sizes: Sequence[tuple[int, int]]) -> tuple[list[int], Any, Any]:
    """The row's expanded prompt ids, ``pixel_values`` and ``image_grid_thw``."""
    import torch

    from rlcore.chat.templates import encode_rendered
    from rlcore.chat.vision import vision_prompt

    messages = _messages(len(sizes), row)
    if not sizes:
        text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        empty = torch.zeros(0, _features(processor)), torch.zeros(0, 3, dtype=torch.int64)
        return encode_rendered(processor.tokenizer, text), *empty
    images = [draw_image(w, h, 40 + 50 * i + 7 * row) for i, (w, h) in enumerate(sizes)]
    prompt = vision_prompt(processor, messages, images)
    return prompt.ids, prompt.pixel_values.float(), prompt.image_grid_thw.long()


def image_batch(model_path: str, rows: Sequence[Sequence[tuple[int, int]]] = DEFAULT_ROWS) -> BatchedDataDict:
    """A training batch of ``rows`` (images per row, as (width, height)) for the VLM at ``model_path``: ``input_ids``
    (right-padded with the pad id), ``input_lengths``, ``token_mask`` (1 on the response), ``sample_mask``, and the
    per-row lists ``pixel_values`` and ``image_grid_thw``."""
    import torch

    from rlcore.data import BatchedDataDict
    from rlcore.models import load_vlm_processor

    processor = load_vlm_processor(model_path)
    tokenizer = processor.tokenizer
    sequences, prompt_lens, pixels, grids = [], [], [], []
    for row, sizes in enumerate(rows):
        ids, pixel_values, grid = _prompt(processor, row, sizes)
        response = tokenizer(f"A shape {row}.", add_special_tokens=False)["input_ids"]
        sequences.append(ids + response)
        prompt_lens.append(len(ids))
        pixels.append(pixel_values)
        grids.append(grid)
    lengths = torch.tensor([len(s) for s in sequences])
    width = int(lengths.max())
    pad = tokenizer.pad_token_id or 0
    input_ids = torch.full((len(rows), width), pad, dtype=torch.int64)
    for b, seq in enumerate(sequences):
        input_ids[b, : len(seq)] = torch.tensor(seq)
    positions = torch.arange(width)[None, :]
    token_mask = ((positions >= torch.tensor(prompt_lens)[:, None]) & (positions < lengths[:, None])).float()
    return BatchedDataDict(
        input_ids=input_ids,
        input_lengths=lengths,
        token_mask=token_mask,
        sample_mask=torch.ones(len(rows)),
        pixel_values=pixels,
        image_grid_thw=grids,
    )


def load_reference_model(model_path: str, dtype: torch.dtype | None = None) -> Any:
    """The VLM as Hugging Face loads it, in ``dtype`` (float64 by default), eval mode."""
    import torch
    from transformers import AutoModelForImageTextToText

    model: Any = AutoModelForImageTextToText.from_pretrained(model_path, dtype=torch.float32)
    return model.to(dtype or torch.float64).eval()


def _row_logprobs(model: Any, data: BatchedDataDict, b: int) -> torch.Tensor:
    """Row ``b``'s token logprobs in the contract's alignment (``[length]``, position 0 is 0), grad-enabled."""
    import torch

    length = int(data["input_lengths"][b])
    ids = data["input_ids"][b : b + 1, :length]
    kwargs: dict[str, Any] = {"input_ids": ids, "mm_token_type_ids": (ids == model.config.image_token_id).int()}
    if data["pixel_values"][b].shape[0]:
        kwargs["pixel_values"] = data["pixel_values"][b].to(model.dtype)
        kwargs["image_grid_thw"] = data["image_grid_thw"][b]
    logits = model(**kwargs, use_cache=False).logits[0]
    next_lp = torch.log_softmax(logits[:-1], dim=-1).gather(-1, ids[0, 1:, None])[:, 0]
    return torch.cat([next_lp.new_zeros(1), next_lp])


def reference_logprobs(model: Any, data: BatchedDataDict) -> torch.Tensor:
    """``[B, S]`` logprobs of ``model`` (see :func:`load_reference_model`), one row at a time; 0 at position 0
    and on padding."""
    import torch

    out = torch.zeros(data["input_ids"].shape, dtype=torch.float64)
    with torch.no_grad():
        for b in range(out.shape[0]):
            lp = _row_logprobs(model, data, b)
            out[b, : lp.shape[0]] = lp.double()
    return out


def reference_sgd_step(model: Any, data: BatchedDataDict, loss_fn: Any, lr: float) -> tuple[float, dict]:
    """One plain SGD step of ``model`` on the whole batch (normalised by the batch's valid tokens and sequences, as
    rlcore's step loop does): the loss and the weights after the step (in-memory names), float64."""
    import torch

    model.train()
    rows = [_row_logprobs(model, data, b) for b in range(data["input_ids"].shape[0])]
    logprobs = torch.zeros(data["input_ids"].shape, dtype=rows[0].dtype)
    for b, lp in enumerate(rows):
        logprobs = logprobs.index_put((torch.tensor([b]), torch.arange(lp.shape[0])), lp)
    sample_mask = data["sample_mask"].double()
    tokens = (data["token_mask"][:, 1:].double() * sample_mask[:, None]).sum()
    loss, _ = loss_fn(logprobs, data, sample_mask.sum(), tokens)
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= lr * p.grad
    model.eval()
    return float(loss.detach()), {k: v.detach().clone() for k, v in model.state_dict().items()}


__all__ = [
    "DEFAULT_ROWS",
    "draw_image",
    "image_batch",
    "load_reference_model",
    "reference_logprobs",
    "reference_sgd_step",
]
