"""SFT batches of a vision-language model (docs/vision.md): each message's image tokens expanded as the model's
processor expands the whole conversation, the loss mask on the assistant's tokens only, the pixels row for row;
a sample cut for length shows no image (its image tokens become padding) and trains nothing."""

from __future__ import annotations

import pytest
import torch

from rlcore.algorithms.sft.batches import nothing_trained, sft_batch
from rlcore.config import load_config
from rlcore.datasets import Sample
from rlcore.models import load_vlm_processor, resolve_model


@pytest.fixture(scope="module")
def vlm_path() -> str:
    return resolve_model("tiny-qwen2.5-vl")


def picture(width: int, height: int, shade: int):
    from PIL import Image

    return Image.new("RGB", (width, height), (shade, 90, 255 - shade))


def config(path: str, max_total: int):
    overrides = {"policy.model_name": path, "policy.max_total_sequence_length": str(max_total), "sft.max_num_steps": 1}
    return load_config(None, [f"{k}={v}" for k, v in overrides.items()])


def conversation(images: int, answer: str) -> list[dict]:
    parts = [{"type": "image"} for _ in range(images)] + [{"type": "text", "text": "How many squares?"}]
    return [{"role": "user", "content": parts}, {"role": "assistant", "content": answer}]


def test_image_tokens_are_expanded_in_place_and_only_the_answer_trains(vlm_path):
    processor = load_vlm_processor(vlm_path)
    tokenizer = processor.tokenizer
    images = [picture(56, 56, 20), picture(90, 60, 200)]
    two = Sample(0, conversation(2, "Two"), {}, images)
    plain = Sample(1, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}], {})
    batch = sft_batch([two, plain], tokenizer, config(vlm_path, 400))
    text = processor.apply_chat_template(two.messages, tokenize=False)
    reference = processor(text=[text], images=images, return_tensors="pt")
    length = int(batch["input_lengths"][0])
    ids = batch["input_ids"][0, :length].tolist()
    expected = reference["input_ids"][0].tolist()
    assert ids[: len(expected)] == expected
    assert ids[len(expected) :] == [tokenizer.eos_token_id]  # sft.add_eos: the template ends with "\n"
    torch.testing.assert_close(batch["pixel_values"][0], reference["pixel_values"], rtol=0, atol=0)
    assert batch["image_grid_thw"][0].tolist() == reference["image_grid_thw"].tolist()
    trained = [t for t, m in zip(ids, batch["token_mask"][0].tolist()) if m]
    assert processor.image_token_id not in trained
    assert tokenizer.decode(trained).startswith("<|assistant|>\nTwo")
    assert batch["pixel_values"][1].shape[0] == 0 and batch["sample_mask"].tolist() == [1.0, 1.0]


def test_a_sample_cut_for_length_shows_no_image_and_trains_nothing(vlm_path):
    tokenizer = load_vlm_processor(vlm_path).tokenizer
    big = Sample(0, conversation(1, "One"), {}, [picture(224, 224, 50)])  # 64 image tokens: over the limit
    small = Sample(1, conversation(1, "One"), {}, [picture(28, 28, 90)])  # min_pixels: a few tokens
    batch = sft_batch([big, small], tokenizer, config(vlm_path, 64), size=3)
    assert batch["sample_mask"].tolist() == [0.0, 1.0, 0.0]
    image_token = load_vlm_processor(vlm_path).image_token_id
    for row in (0, 2):  # the cut sample, and the filler row
        assert image_token not in batch["input_ids"][row].tolist()
        assert batch["pixel_values"][row].shape[0] == 0 and batch["image_grid_thw"][row].shape == (0, 3)
    assert int((batch["input_ids"][1] == image_token).sum()) == int(batch["image_grid_thw"][1].prod()) // 4  # merge 2
    assert nothing_trained([big], tokenizer, config(vlm_path, 64)).startswith("all 1 samples are longer")


def test_a_template_that_cannot_render_image_parts_is_one_line(vlm_path):
    from rlcore.datasets import DataError

    tokenizer = load_vlm_processor(vlm_path).tokenizer
    cfg = config(vlm_path, 400)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'].strip() }}{% endfor %}"  # NeMo-RL's squad-like
    sample = Sample(0, conversation(1, "One"), {}, [picture(56, 56, 1)])
    with pytest.raises(DataError, match=r"^policy.tokenizer.chat_template: cannot render a message with image parts"):
        sft_batch([sample], tokenizer, cfg)
