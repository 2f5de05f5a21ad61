"""The generated counting task: pictures of squares, the same per (step, seed), whose answer is the number of
separate blobs a flood fill finds in the pixels."""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest

from rlcore.config import load_config_dict
from rlcore.datasets import load_sources
from rlcore.environments.vlm_tasks import BACKGROUND, QUESTION, count_squares


def _pixels(row: dict) -> np.ndarray:
    return np.asarray(row["messages"][0]["content"][0]["image"])


def _blobs(pixels: np.ndarray) -> list[list[tuple[int, int]]]:
    """The 8-connected regions of pixels that are not the background, by breadth-first flood fill."""
    foreground = np.any(pixels != np.array(BACKGROUND, dtype=pixels.dtype), axis=2)
    seen = np.zeros_like(foreground)
    blobs = []
    for start in zip(*np.nonzero(foreground)):
        if seen[start]:
            continue
        seen[start] = True
        queue, blob = deque([start]), []
        while queue:
            y, x = queue.popleft()
            blob.append((y, x))
            for dy in (-1, 0, 1):
                for dx in (-1, 0, 1):
                    ny, nx = y + dy, x + dx
                    inside = 0 <= ny < foreground.shape[0] and 0 <= nx < foreground.shape[1]
                    if inside and foreground[ny, nx] and not seen[ny, nx]:
                        seen[ny, nx] = True
                        queue.append((ny, nx))
        blobs.append(blob)
    return blobs


def test_the_answer_is_the_number_of_separate_squares_in_the_pixels():
    rows = [row for step in range(6) for row in count_squares(step, 8, seed=3, size=56)]
    counts = []
    for row in rows:
        pixels = _pixels(row)
        assert pixels.shape == (56, 56, 3) and pixels.dtype == np.uint8
        blobs = _blobs(pixels)
        assert len(blobs) == int(row["output"])
        for blob in blobs:  # each blob a filled square of one colour
            ys, xs = zip(*blob)
            height, width = max(ys) - min(ys) + 1, max(xs) - min(xs) + 1
            assert height == width and len(blob) == height * width
            assert len({tuple(pixels[y, x]) for y, x in blob}) == 1
        counts.append(int(row["output"]))
    assert set(counts) == {1, 2, 3, 4}  # 48 pictures: every count drawn
    assert row["messages"][0]["content"][1] == {"type": "text", "text": QUESTION}


def test_the_rows_are_the_same_per_step_and_seed_and_differ_across_steps():
    def pictures(step: int, seed: int) -> list[np.ndarray]:
        return [_pixels(row) for row in count_squares(step, 4, seed=seed)]

    first, again = pictures(5, 1), pictures(5, 1)
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert [r["output"] for r in count_squares(5, 4, seed=1)] == [r["output"] for r in count_squares(5, 4, seed=1)]
    assert not all(np.array_equal(a, b) for a, b in zip(first, pictures(6, 1)))
    assert not all(np.array_equal(a, b) for a, b in zip(first, pictures(5, 2)))


def test_a_generated_step_becomes_samples_holding_the_pictures():
    cfg = load_config_dict(
        {
            "data": {
                "train": {
                    "generator": "rlcore.environments.vlm_tasks:count_squares",
                    "generator_kwargs": {"size": 48, "max_count": 3},
                }
            },
            "grpo": {"num_prompts_per_step": 2, "seed": 7},
        }
    )
    samples = load_sources(cfg, images=True).train.batch(4)
    rows = count_squares(4, 2, seed=7, size=48, max_count=3)
    for sample, row in zip(samples, rows, strict=True):
        assert sample.messages == [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
        assert len(sample.images) == 1 and np.array_equal(np.asarray(sample.images[0]), _pixels(row))
        assert sample.metadata == {"output": row["output"], "ground_truth": row["output"]}
        assert 1 <= int(row["output"]) <= 3


def test_a_canvas_too_small_for_the_squares_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^count_squares: size 12 is too small for 4 squares; give size >= 16$"):
        count_squares(0, 1, size=12)


def test_the_count_reward_pays_the_format_and_the_right_count_apart():
    from rlcore.environments.vlm_tasks import count_reward

    metadata = [{"ground_truth": "3"}] * 5
    got = count_reward(["q"] * 5, ["3", " 2 squares", "three", "13", "33x"], metadata)
    assert got == {"format": [0.2, 0.2, 0.0, 0.2, 0.2], "count": [0.8, 0.0, 0.0, 0.0, 0.8]}  # the first digit
