"""A CPU vLLM engine serves the tiny Qwen2.5-VL with images, and its logprobs are the trainer's (issue 57).

The engine runs in a child Python process (this file run as a script): it gets the chat template's ids, one
``<|image_pad|>`` per image, plus the images, samples at temperature 1 with ``processed_logprobs``, and writes
what it returned as JSON. The test rebuilds each trained sequence (the HF processor's expanded prompt + the
engine's tokens) and recomputes the sampled tokens' logprobs with the Hugging Face model's float32 forward.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from rl_vllm.multimodal import engine_prompt, image_engine_kwargs

if TYPE_CHECKING:
    from PIL.Image import Image
    from transformers import ProcessorMixin

MODEL = "tiny-qwen2.5-vl"
#: Each prompt: the (width, height) of its images. 56x56 is 4 image tokens, 90x60 resizes to 84x56: 6.
PROMPT_IMAGES = [[(56, 56)], [(90, 60), (56, 56)]]
MAX_NEW = 6
#: float32 engine against a float32 forward of the same weights (the refit tests' bound): the kernels differ
#: (vLLM's attention, rotary and fused norms), so the last bits do: measured 4.8e-7 for both prompts.
ATOL = 1e-4


def draw_image(width: int, height: int, shade: int) -> Image:
    """An RGB picture whose colours depend on ``shade``: a background, a rectangle and an ellipse."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (width, height), (shade, 255 - shade, 90))
    pen = ImageDraw.Draw(image)
    pen.rectangle((4, 6, width // 2, height - 8), fill=(255 - shade, 30, shade))
    pen.ellipse((width // 3, 2, width - 3, height // 2), fill=(20, shade, 200))
    return image


def conversation(n_images: int) -> list[dict[str, object]]:
    parts: list[dict[str, str]] = [{"type": "image"} for _ in range(n_images)]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "Describe."}]}]


def make_prompts(processor: ProcessorMixin) -> list[tuple[str, list[Image]]]:
    """(chat text, images) of each prompt."""
    prompts = []
    for i, sizes in enumerate(PROMPT_IMAGES):
        text = processor.apply_chat_template(conversation(len(sizes)), add_generation_prompt=True, tokenize=False)
        prompts.append((text, [draw_image(w, h, 40 + 70 * i + 30 * j) for j, (w, h) in enumerate(sizes)]))
    return prompts


def run_engine(model_dir: str, out_path: str) -> None:
    """The child process: start an in-process engine, generate for every prompt, write the outputs as JSON."""
    import time

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    from rl_vllm.cpu_setup import request_amx_permission
    from rl_vllm.multimodal import IMAGE_PAD_TOKEN, qwen2_vl_without_torchvision
    from rlcore.models import load_vlm_processor

    request_amx_permission()
    processor = load_vlm_processor(model_dir)
    tokenizer = processor.tokenizer
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD_TOKEN)
    prompts = [
        engine_prompt(tokenizer(text, add_special_tokens=False)["input_ids"], images, image_token_id)
        for text, images in make_prompts(processor)
    ]
    with qwen2_vl_without_torchvision():
        from vllm import LLM, SamplingParams

        started = time.perf_counter()
        llm = LLM(
            model=model_dir,
            tokenizer=model_dir,
            dtype="float32",
            seed=0,
            enforce_eager=True,
            max_model_len=256,
            kv_cache_memory_bytes=16 << 20,
            logprobs_mode="processed_logprobs",
            **image_engine_kwargs(max(len(sizes) for sizes in PROMPT_IMAGES)),
        )
        start_s = time.perf_counter() - started
        params = [
            SamplingParams(temperature=1.0, max_tokens=MAX_NEW, logprobs=0, seed=11 + i, ignore_eos=True)
            for i in range(len(prompts))
        ]
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        generate_s = time.perf_counter() - started
        # the same prompts, already expanded by the HF processor: what vLLM makes of them
        expanded = [
            {**prompt, "prompt_token_ids": processor(text=[text], images=images)["input_ids"][0]}
            for prompt, (text, images) in zip(prompts, make_prompts(processor))
        ]
        reexpanded = llm.generate(expanded, [params[0]] * len(expanded), use_tqdm=False)
        del llm
    results = {
        "start_s": start_s,
        "generate_s": generate_s,
        "prompt_ids": [list(o.prompt_token_ids) for o in outputs],
        "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
        "logprobs": [[d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outputs],
        "reexpanded_lengths": [len(o.prompt_token_ids) for o in reexpanded],
    }
    Path(out_path).write_text(json.dumps(results))


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from rlcore.models import resolve_model

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RLCORE_CACHE", str(tmp_path_factory.mktemp("cache")))
        return resolve_model(MODEL)


@pytest.mark.slow
def test_engine_logprobs_match_the_float32_forward(vlm_dir: str, tmp_path: Path) -> None:
    import torch
    import transformers

    from rlcore.models import load_vlm_processor

    out = tmp_path / "engine.json"
    child = subprocess.run([sys.executable, __file__, vlm_dir, str(out)], capture_output=True, text=True, timeout=540)
    assert child.returncode == 0, child.stderr[-4000:]
    engine = json.loads(out.read_text())
    print(f"engine start {engine['start_s']:.1f} s, generate {engine['generate_s']:.1f} s")
    print(f"expanded ids fed to vLLM come back {engine['reexpanded_lengths']} tokens long")

    processor = load_vlm_processor(vlm_dir)
    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(vlm_dir, dtype=torch.float32).eval()
    vision_ids = set(processor.tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>"]))
    vision_ids |= {processor.image_token_id, processor.video_token_id}
    for i, (text, images) in enumerate(make_prompts(processor)):
        batch = processor(text=[text], images=images, return_tensors="pt")
        prompt = batch["input_ids"][0]
        # vLLM's expanded prompt is the processor's, token for token
        assert engine["prompt_ids"][i] == prompt.tolist()
        # fed the expanded ids, vLLM expands again: the prompt it runs is not the trainer's
        assert engine["reexpanded_lengths"][i] != len(prompt), engine["reexpanded_lengths"]
        generated = torch.tensor(engine["token_ids"][i])
        assert len(generated) == MAX_NEW
        assert not vision_ids & set(generated.tolist()), "a vision token was sampled: pick another seed"
        sequence = torch.cat([prompt, generated])[None]
        inputs = dict(
            input_ids=sequence,
            attention_mask=torch.ones_like(sequence),
            pixel_values=batch["pixel_values"],
            image_grid_thw=batch["image_grid_thw"],
            mm_token_type_ids=torch.nn.functional.pad(batch["mm_token_type_ids"], (0, MAX_NEW)),
        )
        with torch.no_grad():
            logits = model(**inputs).logits[0, len(prompt) - 1 : -1]
        want = torch.log_softmax(logits, dim=-1).gather(1, generated[:, None])[:, 0]
        got = torch.tensor(engine["logprobs"][i])
        difference = float((got - want).abs().max())
        print(f"prompt {i}: {len(images)} image(s), {len(prompt)} prompt tokens, max |diff| {difference:.2e}")
        assert difference < ATOL
        # without mm_token_type_ids the forward falls back to 1D positions: the test can tell them apart
        del inputs["mm_token_type_ids"]
        with torch.no_grad():
            flat = torch.log_softmax(model(**inputs).logits[0, len(prompt) - 1 : -1], dim=-1)
        flat_difference = float((got - flat.gather(1, generated[:, None])[:, 0]).abs().max())
        print(f"  against 1D positions: max |diff| {flat_difference:.2e}")
        assert flat_difference > 10 * ATOL
        assert float(want.std()) > 0.0  # the tokens' logprobs are not all one value: the comparison says something


def test_engine_prompt_takes_template_ids_and_refuses_expanded_ones() -> None:
    from PIL import Image

    pad, images = 262, [Image.new("RGB", (28, 28)), Image.new("RGB", (56, 28))]
    ids = [1, 50, pad, 51, 52, pad, 53]
    prompt = engine_prompt(ids, images, pad)
    assert prompt["prompt_token_ids"] == ids
    assert prompt.get("multi_modal_data") == {"image": images}
    assert engine_prompt([1, 50], [], pad) == {"prompt_token_ids": [1, 50]}
    with pytest.raises(ValueError, match="expanded"):
        engine_prompt([1, pad, pad, pad, 2], images[:1], pad)
    with pytest.raises(ValueError, match="2 image tokens .* for 1 images"):
        engine_prompt(ids, images[:1], pad)
    assert image_engine_kwargs(2) == {"limit_mm_per_prompt": {"image": 2, "video": 0}}
    with pytest.raises(ValueError, match="max_images_per_prompt"):
        image_engine_kwargs(0)


if __name__ == "__main__":
    run_engine(sys.argv[1], sys.argv[2])
