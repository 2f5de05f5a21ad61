"""A CPU vLLM engine serves the tiny Qwen2.5-VL with images, and its logprobs are the trainer's (issue 57).

The engine runs in a child Python process (this file run as a script): it gets the chat template's ids, one
``<|image_pad|>`` per image, plus the images, samples at temperature 1 with ``processed_logprobs``, and writes
what it returned as JSON. The test rebuilds each trained sequence (the HF processor's expanded prompt + the
engine's tokens) and recomputes the sampled tokens' logprobs with the Hugging Face model's float32 forward.

The fast tests check, without an engine, what the worker builds on: expanded rows collapsed for vLLM and its
prompt checked against them, the driver's refusals of image batches, ``vllm_cfg.limit_mm_per_prompt``, and refit
info of a vision-language model (``state_dict()`` names, a frozen tower left out). Through the real backend:
``test_multimodal_generation.py``.
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


def test_expanded_rows_are_collapsed_for_the_engine_and_checked_against_its_prompt() -> None:
    from PIL import Image

    from rl_vllm.multimodal import check_engine_prompts, collapse_image_runs, engine_requests, image_runs

    pad, image = 262, Image.new("RGB", (28, 28))
    expanded = [1, 259, pad, pad, pad, 260, 259, pad, 260, 7]
    assert collapse_image_runs(expanded, pad) == [1, 259, pad, 260, 259, pad, 260, 7]
    assert image_runs(expanded, pad) == 2
    requests = engine_requests([expanded, [1, 5, 6]], [[image, image], []], pad)
    collapsed = [1, 259, pad, 260, 259, pad, 260, 7]
    assert requests[0] == {"prompt_token_ids": collapsed, "multi_modal_data": {"image": [image, image]}}
    assert requests[1] == {"prompt_token_ids": [1, 5, 6]}  # a row without images goes as it is
    assert engine_requests([[1, 5]], None, None) == [{"prompt_token_ids": [1, 5]}]
    check_engine_prompts(requests, [expanded, [1, 5, 6]], [expanded, None])  # vLLM's expansion is the batch's
    with pytest.raises(
        RuntimeError, match="row 0: vLLM expanded the prompt's images into 9 prompt tokens, the batch's"
    ):
        check_engine_prompts(requests, [expanded, [1, 5, 6]], [expanded[1:], None])
    with pytest.raises(ValueError, match="row 0 has images, but the engine serves a text model"):
        engine_requests([expanded], [[image, image]], None)


def test_image_batch_problems_name_the_rows_and_the_text_model() -> None:
    import torch
    from PIL import Image

    from rl_vllm.multimodal import image_batch_problems, multimodal_engine_kwargs

    pad, image = 262, Image.new("RGB", (28, 28))
    ids = torch.tensor([[1, pad, pad, 2, 0], [1, pad, 3, pad, 2]])
    batch = {"input_ids": ids, "input_lengths": torch.tensor([4, 5]), "images": [[image], [image, image]]}
    assert image_batch_problems(batch, pad, "vlm") == []
    assert image_batch_problems({**batch, "images": [[], []]}, None, "text") == []  # no images: any engine
    (text,) = image_batch_problems(batch, None, "/models/llama")
    assert text.startswith("the batch has images, but the engine serves the text model /models/llama")
    (rows,) = image_batch_problems({**batch, "images": [[image], [image]]}, pad, "vlm")
    assert rows.endswith("(row, runs, images) [(1, 2, 1)]")
    (bare,) = image_batch_problems({**batch, "images": [[image], []]}, pad, "vlm")  # image tokens, no images
    assert bare.endswith("(row, runs, images) [(1, 2, 0)]")
    assert image_batch_problems({**batch, "images": [[image]]}, pad, "vlm") == [
        "images has 1 entries for a batch of 2 (one list of images per row)"
    ]
    assert multimodal_engine_kwargs({"image": 2}, vision=True) == {"limit_mm_per_prompt": {"image": 2, "video": 0}}
    assert multimodal_engine_kwargs({"image": 2}, vision=False) == {"limit_mm_per_prompt": {"image": 2}}
    assert multimodal_engine_kwargs(None, vision=False) == {}


def test_vllm_cfg_takes_nemo_rls_image_limits() -> None:
    from rl_vllm.config import VllmConfig
    from rlcore.config import ConfigError, validate_section

    config, problems = validate_section(
        VllmConfig, {"limit_mm_per_prompt": {"image": 1}, "engine_kwargs": {"mm_processor_cache_gb": 0}}, "vllm_cfg"
    )
    assert not problems and config is not None
    assert config.limit_mm_per_prompt == {"image": 1} and config.engine_kwargs == {"mm_processor_cache_gb": 0}
    config, problems = validate_section(VllmConfig, {"limit_mm_per_prompt": {"image": -1}}, "vllm_cfg")
    assert config is None and "limit_mm_per_prompt" in str(ConfigError(problems))


def test_refit_info_of_a_vlm_takes_state_dict_names_and_a_frozen_tower(vlm_dir: str, tiny_model_dir: str) -> None:
    from rl_vllm.multimodal import vision_image_token
    from rl_vllm.refit import checkpoint_shapes, metadata_problems, without_tower

    assert vision_image_token(vlm_dir) == 262 and vision_image_token(tiny_model_dir) is None
    assert not without_tower({"model.norm.weight": ((8,), "float32")}, tiny_model_dir)  # a text model has no tower

    shapes = checkpoint_shapes(vlm_dir)
    assert shapes is not None and "visual.merger.mlp.0.weight" in shapes  # save_pretrained's layout
    renamed = {
        "model.layers.": "model.language_model.layers.",
        "model.embed_tokens.": "model.language_model.embed_tokens.",
        "model.norm.": "model.language_model.norm.",
        "visual.": "model.visual.",
    }

    def state_dict_name(name: str) -> str:
        return next((new + name[len(old) :] for old, new in renamed.items() if name.startswith(old)), name)

    info = {state_dict_name(n): (shape, "float32") for n, shape in shapes.items()}
    assert "model.visual.merger.mlp.0.weight" in info and "model.language_model.norm.weight" in info
    assert metadata_problems(info, vlm_dir) == []
    assert not without_tower(info, vlm_dir)
    language = {n: v for n, v in info.items() if not n.startswith("model.visual.")}
    assert metadata_problems(language, vlm_dir) == [] and without_tower(language, vlm_dir)
    part_of_tower = {**language, "model.visual.merger.mlp.0.weight": info["model.visual.merger.mlp.0.weight"]}
    (missing,) = metadata_problems(part_of_tower, vlm_dir)
    assert missing.startswith("refit info lacks") and "visual." in missing
    no_head = {n: v for n, v in language.items() if n != "lm_head.weight"}
    assert metadata_problems(no_head, vlm_dir) == ["refit info lacks 1 tensor(s) of the engine's model: lm_head.weight"]


if __name__ == "__main__":
    run_engine(sys.argv[1], sys.argv[2])
