"""The tiny Qwen2.5-VL (``tiny-qwen2.5-vl``) and the ``qwen2.5-vl-3b`` preset: processor, logprobs, cache, shapes.

One model is built per module, through ``resolve_model`` into a temporary cache;
the 3B preset is only instantiated on the meta device.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import transformers

from rlcore.models import BUILTIN_MODELS, VISION_TOKENS, cache, load_vlm_processor, resolve_model, vlm_config
from rlcore.models.presets import PARAMETER_COUNTS, VLM_PRESETS
from rlcore.models.tokenizer import BYTE_OFFSET

NAME = "tiny-qwen2.5-vl"


@pytest.fixture(scope="module")
def vlm_path(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RLCORE_CACHE", str(tmp_path_factory.mktemp("cache")))
        path = resolve_model(NAME)
        # a second resolution finds the built model and builds nothing
        mp.setattr(cache, "build_tiny_vlm", lambda *a, **k: pytest.fail("rebuilt"))
        assert resolve_model(NAME) == path
    return path


@pytest.fixture(scope="module")
def model(vlm_path):
    return transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(vlm_path).eval()


@pytest.fixture(scope="module")
def processor(vlm_path):
    return load_vlm_processor(vlm_path)


def draw_image(width: int, height: int, shade: int):
    """An RGB picture: a background, a rectangle and an ellipse whose colours depend on ``shade``."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (width, height), (shade, 255 - shade, 90))
    pen = ImageDraw.Draw(image)
    pen.rectangle((4, 6, width // 2, height - 8), fill=(255 - shade, 30, shade))
    pen.ellipse((width // 3, 2, width - 3, height // 2), fill=(20, shade, 200))
    return image


CONVERSATION = [
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is drawn here?"}]},
    {"role": "assistant", "content": "A red box."},
    {"role": "user", "content": [{"type": "text", "text": "And in this one?"}, {"type": "image"}]},
]
#: (width, height): the second is resized to a multiple of 28 in each direction (84 x 56).
SIZES = [(56, 56), (90, 60)]


def encode(processor, shades=(40, 200)):
    text = processor.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=False)
    images = [draw_image(w, h, s) for (w, h), s in zip(SIZES, shades)]
    return text, processor(text=[text], images=images, return_tensors="pt")


def token_logprobs(model, batch, dtype=torch.float32):
    """Logprob of each next token; all processor outputs go in (``mm_token_type_ids`` enables the 3D positions)."""
    inputs = dict(batch, pixel_values=batch["pixel_values"].to(dtype))
    with torch.no_grad():
        logits = model(**inputs).logits
    logprobs = torch.log_softmax(logits[:, :-1].to(torch.float64), dim=-1)
    return logprobs.gather(-1, batch["input_ids"][:, 1:, None])[..., 0]


def test_tokenizer_and_config_ids_agree(model, processor):
    tokenizer = processor.tokenizer
    ids = tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))
    assert ids == list(range(BYTE_OFFSET + 256, BYTE_OFFSET + 256 + len(VISION_TOKENS)))
    by_token = dict(zip(VISION_TOKENS, ids))
    cfg = model.config
    assert (cfg.image_token_id, cfg.video_token_id) == (by_token["<|image_pad|>"], by_token["<|video_pad|>"])
    assert (cfg.vision_start_token_id, cfg.vision_end_token_id) == (
        by_token["<|vision_start|>"],
        by_token["<|vision_end|>"],
    )
    assert len(tokenizer) <= cfg.text_config.vocab_size
    assert cfg.vision_config.out_hidden_size == cfg.text_config.hidden_size
    # every vision token is a single special token, never split into bytes
    for token, token_id in by_token.items():
        assert tokenizer.encode(token) == [token_id]


def test_processor_expands_each_image_into_its_tokens(processor):
    text, batch = encode(processor)
    merge = processor.image_processor.merge_size
    patch = processor.image_processor.patch_size
    grid = batch["image_grid_thw"]
    # the grid as smart_resize defines it: each side rounded to a multiple of patch * merge
    expected = [[1, round(h / (patch * merge)) * merge, round(w / (patch * merge)) * merge] for w, h in SIZES]
    assert grid.tolist() == expected
    tokens_per_image = (grid.prod(-1) // merge**2).tolist()
    assert tokens_per_image[0] < tokens_per_image[1] < 10  # a handful of tokens per small image

    ids = batch["input_ids"][0]
    image_token_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert int((ids == image_token_id).sum()) == int(grid.prod(-1).sum()) // merge**2
    # each image's tokens form one run between <|vision_start|> and <|vision_end|>
    runs = "".join("x" if t == image_token_id else "." for t in ids.tolist()).split(".")
    assert [len(run) for run in runs if run] == tokens_per_image
    assert batch["pixel_values"].shape == (int(grid.prod(-1).sum()), 3 * 2 * patch * patch)

    # text round-trips: the decoded ids are the rendered chat with each <|image_pad|> repeated
    pieces = text.split("<|image_pad|>")
    assert len(pieces) == 3
    expanded = pieces[0] + "".join("<|image_pad|>" * n + piece for n, piece in zip(tokens_per_image, pieces[1:]))
    assert processor.tokenizer.decode(ids) == expanded
    assert text.startswith("<s><|user|>\n<|vision_start|><|image_pad|><|vision_end|>What is drawn here?</s>\n")
    assert "<|assistant|>\nA red box.</s>\n" in text and text.endswith("</s>\n<|assistant|>\n")


def test_chat_template_renders_string_content(processor):
    text = processor.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == "<s><|user|>\nhi</s>\n"


def expected_mrope_positions(input_ids: list[int], grids: list[list[int]], image_token_id: int, merge: int):
    """Qwen2.5-VL's 3D positions, recomputed: text advances all three; an image's tokens are (start, start + row,
    start + column) on its merged grid, and the text after it resumes at start + max(rows, columns)."""
    positions, cursor, images, i = [], 0, iter(grids), 0
    while i < len(input_ids):
        if input_ids[i] != image_token_id:
            positions.append((cursor, cursor, cursor))
            cursor, i = cursor + 1, i + 1
            continue
        _, height, width = next(images)
        rows, columns = height // merge, width // merge
        positions += [(cursor, cursor + r, cursor + c) for r in range(rows) for c in range(columns)]
        cursor, i = cursor + max(rows, columns), i + rows * columns
    return torch.tensor(positions).T


def test_image_tokens_get_3d_positions(model, processor):
    _, batch = encode(processor)
    image_token_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    positions, _ = model.model.get_rope_index(
        batch["input_ids"],
        batch["mm_token_type_ids"],
        image_grid_thw=batch["image_grid_thw"],
        attention_mask=batch["attention_mask"],
    )
    expected = expected_mrope_positions(
        batch["input_ids"][0].tolist(), batch["image_grid_thw"].tolist(), image_token_id, 2
    )
    assert torch.equal(positions[:, 0], expected)
    assert int(expected.max()) < batch["input_ids"].shape[1] - 1  # fewer positions than tokens: images are 2D


def test_greedy_generation_matches_full_forwards(model, processor):
    """Decoding with the KV cache (positions from the cached rope deltas) gives a full forward's logits."""
    _, batch = encode(processor)
    prompt_len = batch["input_ids"].shape[1]
    with torch.no_grad():
        out = model.generate(
            **batch, max_new_tokens=3, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
        generated = out.sequences
        assert generated.shape == (1, prompt_len + 3)
        full = dict(
            batch,
            input_ids=generated,
            attention_mask=torch.ones_like(generated),
            mm_token_type_ids=torch.nn.functional.pad(batch["mm_token_type_ids"], (0, 3)),
        )
        logits = model(**full).logits[0, prompt_len - 1 : -1]
    torch.testing.assert_close(torch.cat(out.logits), logits, rtol=0, atol=1e-4)
    assert torch.equal(logits.argmax(-1), generated[0, prompt_len:])


def test_float32_logprobs_match_a_float64_copy(model, processor):
    _, batch = encode(processor)
    reference = token_logprobs(copy.deepcopy(model).to(torch.float64), batch, torch.float64)
    got = token_logprobs(model, batch)
    assert got.shape == (1, batch["input_ids"].shape[1] - 1) and torch.isfinite(got).all()
    assert (got - reference).abs().max() < 1e-4


def test_changing_an_image_changes_only_the_logprobs_after_it(model, processor):
    _, batch = encode(processor, shades=(40, 200))
    _, changed = encode(processor, shades=(40, 10))
    assert torch.equal(batch["input_ids"], changed["input_ids"])
    assert not torch.equal(batch["pixel_values"], changed["pixel_values"])
    before, after = token_logprobs(model, batch)[0], token_logprobs(model, changed)[0]

    image_token_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    image_positions = (batch["input_ids"][0] == image_token_id).nonzero()[:, 0]
    second_start = int(image_positions[-(int(batch["image_grid_thw"][1].prod()) // 4)])
    # logprob t predicts token t + 1 from tokens 0..t: up to t = second_start - 1 the second image is unseen
    torch.testing.assert_close(after[:second_start], before[:second_start], rtol=0, atol=1e-6)
    last = int(image_positions[-1])
    assert (after[last:] - before[last:]).abs().max() > 1e-4


def test_auto_classes_load_the_built_model(vlm_path, model):
    loaded = transformers.AutoModelForImageTextToText.from_pretrained(vlm_path)
    assert type(loaded) is type(model)
    for (name, a), (_, b) in zip(loaded.state_dict().items(), model.state_dict().items()):
        assert torch.equal(a, b), name
    assert Path(vlm_path).name.startswith("qwen2_5_vl-")


def test_auto_processor_loads_with_torchvision(vlm_path):
    pytest.importorskip("torchvision", reason="transformers builds Qwen2.5-VL's video processor only with torchvision")
    processor = transformers.AutoProcessor.from_pretrained(vlm_path)
    assert type(processor).__name__ == "Qwen2_5_VLProcessor"
    assert processor.image_processor.merge_size == 2


def test_cache_key_includes_the_vlm_arguments(tmp_path, monkeypatch):
    built = []

    def fake_build(save_dir, **kwargs):
        built.append(kwargs)
        (Path(save_dir) / "config.json").touch()

    monkeypatch.setattr(cache, "build_tiny_vlm", fake_build)
    monkeypatch.setattr(cache, "build_tiny_model", lambda *a, **k: pytest.fail("built as a causal LM"))
    base = cache.tiny_model_path(cache_root=tmp_path, **BUILTIN_MODELS[NAME])
    deeper = cache.tiny_model_path(cache_root=tmp_path, **dict(BUILTIN_MODELS[NAME], vision_depth=3))
    as_list = cache.tiny_model_path(cache_root=tmp_path, **dict(BUILTIN_MODELS[NAME], fullatt_block_indexes=[1]))
    assert base != deeper and as_list == base
    assert len(built) == 2


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="mrope_section"):
        vlm_config(mrope_section=(4, 4, 4))
    with pytest.raises(ValueError, match="fullatt_block_indexes"):
        vlm_config(fullatt_block_indexes=(5,))
    with pytest.raises(ValueError, match="unknown VLM arch"):
        vlm_config(arch="llava")


def test_qwen25_vl_3b_preset_shape_and_count():
    args = VLM_PRESETS["qwen2.5-vl-3b"]
    assert BUILTIN_MODELS["qwen2.5-vl-3b"] == args
    cfg = vlm_config(**args)
    with torch.device("meta"):
        meta = transformers.AutoModelForImageTextToText.from_config(cfg)
    assert sum(p.numel() for p in meta.parameters()) == PARAMETER_COUNTS["qwen2.5-vl-3b"]
    assert meta.lm_head.weight is meta.model.language_model.embed_tokens.weight
    text, vision = cfg.text_config, cfg.vision_config
    assert (text.hidden_size, text.num_hidden_layers, text.num_attention_heads, text.num_key_value_heads) == (
        2048,
        36,
        16,
        2,
    )
    assert (text.intermediate_size, text.vocab_size, text.rms_norm_eps) == (11008, 151936, 1e-6)
    assert text.rope_parameters["rope_theta"] == 1e6 and text.rope_parameters["mrope_section"] == [16, 24, 24]
    # where transformers' vision config defaults are Qwen2.5-VL's, the preset has the same values
    defaults = transformers.Qwen2_5_VLVisionConfig()
    for field in ("depth", "intermediate_size", "num_heads", "patch_size", "spatial_merge_size", "window_size"):
        assert getattr(vision, field) == getattr(defaults, field), field
    assert list(vision.fullatt_block_indexes) == list(defaults.fullatt_block_indexes) == [7, 15, 23, 31]
    assert (vision.hidden_size, vision.out_hidden_size) == (1280, 2048)
