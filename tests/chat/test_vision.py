"""A prompt with images in its two forms: the engine's (the template's ids, one image token per image) and the
trainer's (expanded), against the model's own processor run on the whole text as the reference."""

from __future__ import annotations

import pytest
import torch

from rlcore.chat.vision import expand_image_tokens, vision_prompt
from rlcore.models import load_vlm_processor, resolve_model


@pytest.fixture(scope="module")
def processor():
    return load_vlm_processor(resolve_model("tiny-qwen2.5-vl"))


def picture(width: int, height: int, shade: int):
    from PIL import Image

    return Image.new("RGB", (width, height), (shade, 255 - shade, 40))


MESSAGES = [
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many?"}]},
    {"role": "assistant", "content": "Two."},
    {"role": "user", "content": [{"type": "text", "text": "And here?"}, {"type": "image"}]},
]


def test_the_engine_form_expands_to_what_the_processor_gives_the_trainer(processor):
    images = [picture(56, 56, 10), picture(90, 60, 200)]
    prompt = vision_prompt(processor, MESSAGES, images)
    text = processor.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    reference = processor(text=[text], images=images, return_tensors="pt")  # the processor's own expansion
    assert prompt.ids == reference["input_ids"][0].tolist()
    torch.testing.assert_close(prompt.pixel_values, reference["pixel_values"], rtol=0, atol=0)
    assert prompt.image_grid_thw.tolist() == reference["image_grid_thw"].tolist()
    pad = processor.image_token_id
    assert prompt.engine_ids.count(pad) == 2 and [i for i in prompt.engine_ids if i != pad] == [
        i for i in prompt.ids if i != pad
    ]
    merge = processor.image_processor.merge_size
    assert prompt.ids.count(pad) == int(prompt.image_grid_thw.prod(-1).sum()) // merge**2


def test_images_and_image_parts_must_agree(processor):
    with pytest.raises(ValueError, match=r"the messages show 2 image\(s\) .* the sample has 1"):
        vision_prompt(processor, MESSAGES, [picture(56, 56, 0)])
    with pytest.raises(ValueError, match=r"1 image grid\(s\) for 2 image token\(s\)"):
        expand_image_tokens([5, 9, 9], 9, torch.tensor([[1, 4, 4]]), 2)
