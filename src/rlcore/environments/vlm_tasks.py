"""A counting task for vision-language runs: how many squares does the picture show?

:func:`count_squares` makes the GRPO prompts
(``data.train: {generator: "rlcore.environments.vlm_tasks:count_squares"}``): a small drawn image of 1 to
``max_count`` filled squares, each of its own size and colour on a plain background, asked about in a user message
of an image part and a text part, with the count as the sample's ``ground_truth`` (an exact-match environment
scores it). The squares never touch: the canvas is cut into a grid of cells, one square to a cell with a margin
inside it, so the answer is what a count of the picture's blobs gives.
"""

from __future__ import annotations

import math
import random
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from PIL import Image

#: The question of every sample.
QUESTION = "How many squares are in the image? Answer with a single number."

#: The background of every image, and the range of each channel of a square's colour (darker, so always apart).
BACKGROUND = (255, 255, 255)
COLOUR_CHANNEL = (0, 200)

#: The smallest side of a square, and the empty margin kept inside each cell around it, in pixels.
MIN_SIDE = 4
MARGIN = 2


def _grid(size: int, max_count: int) -> tuple[int, int]:
    """The grid's cells per side and each cell's side, or a one-line error when ``size`` cannot hold them."""
    if max_count < 1:
        raise ValueError(f"count_squares: max_count is {max_count}; give at least 1")
    cells = math.ceil(math.sqrt(max_count))
    cell = size // cells
    if cell - 2 * MARGIN < MIN_SIDE:
        need = cells * (MIN_SIDE + 2 * MARGIN)
        raise ValueError(f"count_squares: size {size} is too small for {max_count} squares; give size >= {need}")
    return cells, cell


def draw_squares(rng: random.Random, size: int, max_count: int) -> tuple[Image.Image, int]:
    """A ``size`` x ``size`` RGB picture of 1..``max_count`` squares drawn from ``rng``, and how many."""
    from PIL import Image, ImageDraw

    cells, cell = _grid(size, max_count)
    count = rng.randint(1, max_count)
    image = Image.new("RGB", (size, size), BACKGROUND)
    draw = ImageDraw.Draw(image)
    for at in rng.sample(range(cells * cells), count):
        row, col = divmod(at, cells)
        side = rng.randint(MIN_SIDE, cell - 2 * MARGIN)
        x = col * cell + MARGIN + rng.randint(0, cell - 2 * MARGIN - side)
        y = row * cell + MARGIN + rng.randint(0, cell - 2 * MARGIN - side)
        colour = tuple(rng.randint(*COLOUR_CHANNEL) for _ in range(3))
        draw.rectangle((x, y, x + side - 1, y + side - 1), fill=colour)  # both corners are inside the square
    return image, count


def count_squares(step: int, n: int, seed: int = 0, size: int = 64, max_count: int = 4) -> list[dict[str, Any]]:
    """``n`` rows for training step ``step``, the same for the same ``(step, seed)``: a user message of the
    picture and :data:`QUESTION`, and the count as ``output``."""
    rng = random.Random(seed * 1_000_003 + step)
    rows = []
    for _ in range(n):
        image, count = draw_squares(rng, size, max_count)
        content = [{"type": "image", "image": image}, {"type": "text", "text": QUESTION}]
        rows.append({"messages": [{"role": "user", "content": content}], "output": str(count)})
    return rows


#: The reward's parts, as NeMo-RL weighs its CLEVR task's format and exact-answer rewards.
FORMAT_WEIGHT, COUNT_WEIGHT = 0.2, 0.8


def count_reward(prompts: list[str], completions: list[str], metadata: list[dict[str, Any]]) -> dict[str, list[float]]:
    """The counting task's reward, for the ``python`` environment: ``format`` (:data:`FORMAT_WEIGHT`) when the
    answer starts with a digit, ``count`` (:data:`COUNT_WEIGHT`) when that digit is the count (1 to 9: what
    follows it is not read, so a young model that has not learned to stop after one token can still be right).
    The first part is what a model learns without looking; only the second needs the picture."""
    import re

    fmt, count = [], []
    for completion, meta in zip(completions, metadata, strict=True):
        digit = re.match(r"\s*(\d)", completion)
        fmt.append(FORMAT_WEIGHT if digit else 0.0)
        right = digit is not None and int(digit.group(1)) == int(meta["ground_truth"])
        count.append(COUNT_WEIGHT if right else 0.0)
    return {"format": fmt, "count": count}
