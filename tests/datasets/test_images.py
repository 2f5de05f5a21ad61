"""Images in samples: every form a row gives an image in decodes to the same pixels, bad ones fail in one line
naming the row and the column, and JSONL files and datasets directories read into samples holding their images."""

from __future__ import annotations

import base64
import io
import json
import os

import numpy as np
import pytest

from rlcore.config import load_config_dict
from rlcore.datasets import DataError, Sample, SampleBuilder, load_sources
from rlcore.datasets.images import decode_image

WHERE, WHAT = "d.jsonl: row 3", "column 'images' item 2"


def _pixels(seed: int, shape: tuple[int, int] = (5, 7)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (*shape, 3), dtype=np.uint8)


def _png(pixels: np.ndarray, mode: str = "RGB") -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(pixels).convert(mode).save(buffer, format="PNG")
    return buffer.getvalue()


def _open_fds_on(path) -> int:
    return sum(1 for fd in os.listdir("/proc/self/fd") if os.path.realpath(f"/proc/self/fd/{fd}") == str(path))


def test_every_source_form_decodes_to_the_same_rgb_pixels(tmp_path):
    from PIL import Image

    pixels = _pixels(0)
    png = _png(pixels)
    (tmp_path / "imgs").mkdir()
    path = tmp_path / "imgs" / "a.png"
    path.write_bytes(png)
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    forms = {
        "PIL image": Image.fromarray(pixels),
        "RGBA PIL image": Image.fromarray(np.dstack([pixels, np.full(pixels.shape[:2], 255, np.uint8)])),
        "lazily opened file": Image.open(path),
        "bytes": png,
        "bytearray": bytearray(png),
        "memoryview": memoryview(png),
        "datasets value, bytes": {"bytes": png, "path": "ignored-when-bytes.png"},
        "datasets value, path": {"bytes": None, "path": str(path)},
        "absolute path": str(path),
        "pathlib path": path,
        "data URL": url,
    }
    for name, source in forms.items():
        image = decode_image(source, WHERE, WHAT)
        assert image.mode == "RGB" and image.size == (7, 5), name
        np.testing.assert_array_equal(np.asarray(image), pixels, err_msg=name)
    relative = decode_image("imgs/a.png", WHERE, WHAT, base_dir=tmp_path)  # against the data file's directory
    np.testing.assert_array_equal(np.asarray(relative), pixels)
    assert _open_fds_on(path) <= 1  # only the test's own lazily opened image, never one of decode_image's
    forms["lazily opened file"].close()
    decode_image(path, WHERE, WHAT)
    assert _open_fds_on(path) == 0


def test_grey_and_jpeg_images_become_rgb():
    grey = np.arange(35, dtype=np.uint8).reshape(5, 7) * 7
    image = decode_image(_png(np.dstack([grey] * 3), mode="L"), WHERE, WHAT)
    np.testing.assert_array_equal(np.asarray(image), np.dstack([grey] * 3))  # L -> R = G = B
    from PIL import Image

    flat = np.zeros((16, 16, 3), np.uint8)
    flat[:8, :8], flat[8:, 8:] = (200, 30, 60), (20, 120, 240)
    buffer = io.BytesIO()
    Image.fromarray(flat).save(buffer, format="JPEG", quality=95, subsampling=0)
    decoded = np.asarray(decode_image(buffer.getvalue(), WHERE, WHAT)).astype(np.float64)
    assert np.abs(decoded - flat).max() <= 3  # lossy, but the same picture


@pytest.mark.parametrize(
    "source, why",
    [
        (42, r"is int, not an image; give a PIL image"),
        (b"not an image at all", r"19 bytes: not a readable image \(not a format Pillow reads\)"),
        ("truncated", r"not a readable image"),
        ("missing.png", r"cannot read image file .*missing.png: No such file or directory"),
        ("dir", r"cannot read image file .*dir: Is a directory"),
        ({"bytes": None, "path": None}, r"an image value with neither bytes nor path"),
        ("https://example.com/a.png", r"is a URL, which rlcore does not fetch"),
        ("data:text/plain;base64,AAAA", r"a data URL must read 'data:image/<type>;base64,<data>'"),
        ("data:image/png;base64,!!!", r"the data URL's base64 does not decode"),
    ],
)
def test_a_bad_source_fails_in_one_line_naming_the_row_and_column(tmp_path, source, why):
    (tmp_path / "dir").mkdir()
    (tmp_path / "truncated").write_bytes(_png(_pixels(1, (40, 40)))[:200])
    with pytest.raises(DataError, match=rf"^d.jsonl: row 3: column 'images' item 2: .*{why}") as info:
        decode_image(source, WHERE, WHAT, base_dir=tmp_path)
    assert "\n" not in str(info.value)


def _config(path, **data):
    return load_config_dict(
        {
            "data": {"train": {"path": str(path)}, "shuffle": False, **data},
            "grpo": {"num_prompts_per_step": 2},
        }
    )


def test_a_jsonl_file_of_image_paths_reads_into_samples_with_their_pixels(tmp_path, monkeypatch):
    (tmp_path / "imgs").mkdir()
    pixels = {name: _pixels(seed) for seed, name in enumerate("abc")}
    for name, array in pixels.items():
        (tmp_path / "imgs" / f"{name}.png").write_bytes(_png(array))
    rows = [
        {"problem": "Which is brighter?", "images": ["imgs/a.png", "imgs/b.png"], "answer": "a"},  # before the text
        {"problem": "unused", "images": "imgs/c.png", "messages": [{"role": "user", "content": "Describe."}]},
        {  # its own image part first, then the column's for the bare part
            "images": ["imgs/a.png"],
            "messages": [
                {"role": "user", "content": [{"type": "image", "image": "imgs/c.png"}, {"type": "text", "text": "vs"}]},
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": [{"type": "text", "text": "and"}, {"type": "image"}]},
            ],
        },
    ]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    monkeypatch.chdir(tmp_path / "imgs")  # relative paths are the data file's, not the working directory's
    cfg = _config(tmp_path / "d.jsonl", input_key="problem", output_key="answer", image_key="images")
    samples = list(load_sources(cfg, images=True).train.samples)
    image, text = {"type": "image"}, lambda t: {"type": "text", "text": t}
    assert samples[0].messages == [{"role": "user", "content": [image, image, text("Which is brighter?")]}]
    assert samples[1].messages == [{"role": "user", "content": [image, text("Describe.")]}]
    assert samples[2].messages == [
        {"role": "user", "content": [image, text("vs")]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [text("and"), image]},
    ]
    for sample, names in zip(samples, ["ab", "c", "ca"]):
        assert len(sample.images) == len(names)
        for got, name in zip(sample.images, names):
            np.testing.assert_array_equal(np.asarray(got), pixels[name])
    assert samples[0].metadata == {"problem": "Which is brighter?", "answer": "a", "ground_truth": "a"}
    with pytest.raises(DataError, match=r"d.jsonl: row 1: the sample has 2 image\(s\) .* trains on text only"):
        load_sources(cfg)  # an algorithm that does not train on images refuses them rather than drop them
    rows[1]["images"] = ["imgs/c.png", "imgs/gone.png"]
    (tmp_path / "d2.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(DataError, match=r"d2.jsonl: row 2: column 'images' item 2: cannot read image file .*gone.png"):
        list(
            load_sources(
                _config(tmp_path / "d2.jsonl", input_key="problem", image_key="images"), images=True
            ).train.samples
        )


def test_a_datasets_directory_with_an_image_feature_reads_into_samples(tmp_path):
    datasets = pytest.importorskip("datasets")
    arrays = [[_pixels(10), _pixels(11)], [_pixels(12)]]
    image, text = {"type": "image"}, lambda t: {"type": "text", "text": t}
    table = datasets.Dataset.from_dict(
        {
            "messages": [  # Arrow gives every part every key: the image parts get text None, and no image
                [{"role": "user", "content": [image, text("same?"), image]}],
                [{"role": "user", "content": [text("what colour?"), image]}],
            ],
            "images": [[{"bytes": _png(a), "path": None} for a in row] for row in arrays],
            "answer": ["no", "grey"],
        }
    ).cast_column("images", datasets.Sequence(datasets.Image()))
    table.save_to_disk(str(tmp_path / "ds"))
    samples = list(
        load_sources(_config(tmp_path / "ds", output_key="answer", image_key="images"), images=True).train.samples
    )
    assert samples[0].messages == [{"role": "user", "content": [image, text("same?"), image]}]
    assert samples[1].messages == [{"role": "user", "content": [text("what colour?"), image]}]
    for sample, expected in zip(samples, arrays):
        assert [np.asarray(got).tolist() for got in sample.images] == [a.tolist() for a in expected]
    assert [s.metadata for s in samples] == [
        {"answer": "no", "ground_truth": "no"},
        {"answer": "grey", "ground_truth": "grey"},
    ]


@pytest.mark.parametrize(
    "row, data, message",
    [
        (
            {"messages": [{"role": "user", "content": [{"type": "image"}]}]},
            {},
            r"row 4: field 'messages' has an image part without an image: give the part its 'image', or set "
            r"data.image_key",
        ),
        (
            {"images": [b"x"], "messages": [{"role": "user", "content": [{"type": "image"}, {"type": "image"}]}]},
            {"image_key": "images"},
            r"row 4: field 'messages' has at least 2 image parts without an image, but column 'images'",
        ),
        (
            {"images": [b"x", b"y"], "messages": [{"role": "user", "content": [{"type": "image"}]}]},
            {"image_key": "images"},
            r"row 4: column 'images' \(data.image_key\) holds 2 images, but the messages have 1 image parts",
        ),
        ({"problem": "hi"}, {"image_key": "picture"}, r"row 4: no field 'picture' \(data.image_key\)"),
        (
            {"messages": [{"role": "user", "content": [{"type": "video"}]}]},
            {},
            r"row 4: field 'messages' message 1 part 1: expected \{'type': 'text', 'text': ...\}",
        ),
        (
            {"messages": [{"role": "system", "content": "s"}], "images": "a.png"},
            {"image_key": "images"},
            r"row 4: column 'images' \(data.image_key\) holds images, but the messages have no user message",
        ),
    ],
)
def test_images_and_image_parts_that_do_not_match_fail_in_one_line(row, data, message):
    cfg = load_config_dict({"data": {"train": {"path": "unused.jsonl"}, "input_key": "problem", **data}})
    with pytest.raises(DataError, match=message) as info:
        SampleBuilder(cfg.data).sample(row, 3, "d.jsonl: row 4")
    assert "\n" not in str(info.value)


def test_a_sample_without_images_is_built_as_before():
    assert Sample(0, [{"role": "user", "content": "hi"}], {}).images == []
    cfg = load_config_dict({"data": {"train": {"path": "unused.jsonl"}, "image_key": "images"}})
    sample = SampleBuilder(cfg.data).sample({"input": "hi", "images": None}, 0, "row 1")
    assert sample.messages == [{"role": "user", "content": "hi"}] and sample.images == []
