"""The ``vllm`` generation backend serves the tiny Qwen2.5-VL with images (issue 57, docs/vision.md).

Through the real backend (``VllmGeneration`` driving an engine in a Ray actor): a batch in the trainer's frame
(each image placeholder expanded, plus the row's PIL images) comes back in that frame, with logprobs equal to a
float32 Hugging Face forward of the same sequences and pixels. A refit with the names ``state_dict()`` gives
(``model.language_model.*``, ``model.visual.*``) lands in the engine, and so does one of the language model alone
(a frozen vision tower is not sent). One engine for the module (sync, GRPO's default); the continuous-serving
engine and a text model's engine are slow tests of their own.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray
import torch

from rlcore.config import load_config_dict
from rlcore.data import BatchedDataDict
from rlcore.testing.pytest_plugin import ClusterPool

MODEL = "tiny-qwen2.5-vl"
MAX_NEW = 6
#: Each row's images, (width, height): 56x56 is 4 image tokens, 90x60 resizes to 84x56 (6), 56x84: 6; one row has none.
ROWS = [[(56, 56)], [(90, 60), (56, 84)], []]
#: float32 engine against a float32 forward (test_multimodal_engine.py measured 4.8e-7): the kernels differ.
ATOL = 1e-4
BUCKET = 64 << 10  # several buckets for the tiny model


def draw_image(width: int, height: int, shade: int) -> Any:
    """An RGB picture whose colours depend on ``shade``: a background, a rectangle and an ellipse."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (width, height), (shade, 255 - shade, 90))
    pen = ImageDraw.Draw(image)
    pen.rectangle((4, 6, width // 2, height - 8), fill=(255 - shade, 30, shade))
    pen.ellipse((width // 3, 2, width - 3, height // 2), fill=(20, shade, 200))
    return image


def image_batch(processor: Any, rows: list[list[tuple[int, int]]], seeds: list[int]) -> BatchedDataDict:
    """A generation batch per docs/vision.md: expanded ``input_ids`` (right-padded), ``images``, ``pixel_values``,
    ``image_grid_thw`` per row, and a sampling seed per row."""
    from rlcore.chat.templates import encode_rendered
    from rlcore.chat.vision import vision_prompt

    ids, images, pixels, grids = [], [], [], []
    for i, sizes in enumerate(rows):
        own = [draw_image(w, h, 40 + 70 * i + 30 * j) for j, (w, h) in enumerate(sizes)]
        parts: list[dict[str, str]] = [{"type": "image"} for _ in own]
        messages = [{"role": "user", "content": [*parts, {"type": "text", "text": f"Describe {i}."}]}]
        if own:
            prompt = vision_prompt(processor, messages, own)
            ids.append(prompt.ids)
            pixels.append(prompt.pixel_values)
            grids.append(prompt.image_grid_thw)
        else:
            text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            ids.append(encode_rendered(processor.tokenizer, text))
            pixels.append(torch.zeros(0, 1176))
            grids.append(torch.zeros(0, 3, dtype=torch.long))
        images.append(own)
    lengths = torch.tensor([len(row) for row in ids])
    input_ids = torch.zeros(len(ids), int(lengths.max()), dtype=torch.long)
    for i, row in enumerate(ids):
        input_ids[i, : len(row)] = torch.tensor(row)
    return BatchedDataDict(
        input_ids=input_ids,
        input_lengths=lengths,
        images=images,
        pixel_values=pixels,
        image_grid_thw=grids,
        sampling_seeds=torch.tensor(seeds, dtype=torch.long),
    )


def hf_logprobs(model: Any, batch: BatchedDataDict, out: BatchedDataDict, row: int) -> torch.Tensor:
    """The float32 HF forward's logprobs of row ``row``'s generated tokens (the trainer's view of the sequence)."""
    start, end = int(batch["input_lengths"][row]), int(out["unpadded_sequence_lengths"][row])
    sequence = out["output_ids"][row, :end][None]
    inputs: dict[str, Any] = dict(
        input_ids=sequence,
        attention_mask=torch.ones_like(sequence),
        mm_token_type_ids=(sequence == model.config.image_token_id).long(),
    )
    if batch["images"][row]:
        inputs.update(pixel_values=batch["pixel_values"][row], image_grid_thw=batch["image_grid_thw"][row])
    with torch.no_grad():
        logits = model(**inputs).logits[0, start - 1 : end - 1]
    return torch.log_softmax(logits, dim=-1).gather(1, sequence[0, start:end, None])[:, 0]


def assert_matches_hf(model: Any, batch: BatchedDataDict, out: BatchedDataDict) -> list[float]:
    """The output is in the batch's (expanded) frame and its logprobs are the HF forward's; returns the max
    difference of each row."""
    vision = {model.config.image_token_id, model.config.video_token_id, model.config.vision_start_token_id}
    differences = []
    for row in range(len(batch["images"])):
        start, end = int(batch["input_lengths"][row]), int(out["unpadded_sequence_lengths"][row])
        assert torch.equal(out["output_ids"][row, :start], batch["input_ids"][row, :start]), "not the expanded frame"
        assert int(out["generation_lengths"][row]) == end - start == MAX_NEW
        generated = out["output_ids"][row, start:end]
        assert not vision & set(generated.tolist()), "a vision token was sampled: pick other sampling_seeds"
        want = hf_logprobs(model, batch, out, row)
        got = out["logprobs"][row, start:end]
        differences.append(float((got - want).abs().max()))
        assert float(want.std()) > 0.0  # the logprobs are not all one value: the comparison says something
    print("max |engine - HF float32| per row:", [f"{d:.2e}" for d in differences])
    assert max(differences) < ATOL, differences
    return differences


def generation_config(model_dir: str, **vllm_cfg: Any) -> Any:
    return load_config_dict(
        {
            "cluster": {"workers_per_node": 1},
            "policy": {
                "model_name": model_dir,
                "generation": {
                    "backend": "vllm",
                    "max_new_tokens": MAX_NEW,
                    "temperature": 1.0,
                    "pad_token_id": 0,
                    "vllm_cfg": {"kv_cache_space_gb": 0.0625, "max_model_len": 256, **vllm_cfg},
                },
            },
        }
    ).policy.generation


@pytest.fixture(scope="module")
def vlm_dir() -> str:
    from rlcore.models import resolve_model

    path = resolve_model(MODEL)
    assert path is not None
    return path


@pytest.fixture(scope="module")
def processor(vlm_dir: str) -> Any:
    from rlcore.models import load_vlm_processor

    return load_vlm_processor(vlm_dir)


@pytest.fixture(scope="module")
def hf_model(vlm_dir: str) -> Any:
    import transformers

    return transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(vlm_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(ray_session: None, vlm_dir: str) -> Iterator[dict[str, Any]]:
    """One sync engine (NeMo-RL's VLM settings: an image limit, ``vllm_kwargs.mm_processor_cache_gb: 0``)."""
    from rl_vllm.generation import VllmGeneration

    config = generation_config(vlm_dir, limit_mm_per_prompt={"image": 2}, engine_kwargs={"mm_processor_cache_gb": 0})
    clusters = ClusterPool()
    generation = None
    try:
        started = time.perf_counter()
        generation = VllmGeneration(clusters(1), config, name_prefix="vlm-vllm")
        print(f"engine up in {time.perf_counter() - started:.1f} s: {generation.engine_info[0]}")
        yield {"generation": generation}
    finally:
        if generation is not None:
            generation.shutdown()
        clusters.shutdown()


def test_an_image_batch_comes_back_in_the_expanded_frame_with_the_trainers_logprobs(
    engine: dict[str, Any], processor: Any, hf_model: Any
) -> None:
    generation = engine["generation"]
    assert generation.engine_info[0]["image_token_id"] == processor.image_token_id
    batch = image_batch(processor, ROWS, seeds=[3, 4, 5])
    started = time.perf_counter()
    out = generation.generate(batch)
    print(f"generate: {time.perf_counter() - started:.1f} s, prompt lengths {batch['input_lengths'].tolist()}")
    assert out["output_ids"].shape == (len(ROWS), batch["input_ids"].shape[1] + MAX_NEW)
    assert torch.equal(out["unpadded_sequence_lengths"], batch["input_lengths"] + MAX_NEW)
    assert_matches_hf(hf_model, batch, out)
    # the same batch again (seeded requests, its prompts now in the prefix cache with their images): the same
    started = time.perf_counter()
    again = generation.generate(batch)
    print(f"generate again: {time.perf_counter() - started:.1f} s")
    assert torch.equal(again["output_ids"], out["output_ids"])


def test_an_image_batch_that_does_not_fit_its_images_is_refused_on_the_driver(
    engine: dict[str, Any], processor: Any
) -> None:
    generation = engine["generation"]
    batch = image_batch(processor, ROWS[:2], seeds=[3, 4])
    batch["images"] = [batch["images"][0], batch["images"][1][:1]]  # row 1 has two image runs, one image
    with pytest.raises(ValueError, match=r"other numbers of image token runs .* \(row, runs, images\) \[\(1, 2, 1\)\]"):
        generation.generate(batch)
    batch["images"] = batch["images"][:1]
    with pytest.raises(ValueError, match="images has 1 entries for a batch of 2"):
        generation.generate(batch)


def perturbed_state(model: Any, seed: int, vision: bool) -> dict[str, torch.Tensor]:
    """The model's ``state_dict()`` (its own names) with the language model's MLP and attention output scaled,
    and, with ``vision``, one tensor of the vision tower's merger changed."""
    generator = torch.Generator().manual_seed(seed)
    state = {name: tensor.detach().clone().contiguous() for name, tensor in model.state_dict().items()}
    for name, tensor in state.items():
        if name.startswith("model.language_model.layers.") and (".mlp." in name or ".o_proj." in name):
            tensor.mul_(1.0 + 0.5 * torch.rand((), generator=generator))
    if vision:
        merger = "model.visual.merger.mlp.0.weight"
        state[merger] += 0.2 * torch.randn(state[merger].shape, generator=generator)
    return state


def refit(generation: Any, state: dict[str, torch.Tensor]) -> None:
    """Send ``state`` through the engine's shared-memory refit, as a colocated training rank does."""
    from rlcore.refit.shared_memory import stream_to_receiver

    info = {name: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in state.items()}
    generation.prepare_refit_info(info)
    address, key = generation.refit_endpoints()[0]
    receivers = generation.update_weights_via_ipc_zmq(bucket_bytes=BUCKET)
    stream_to_receiver(iter(state.items()), info, address, key, BUCKET, torch.device("cpu"))
    ray.get(receivers, timeout=300)


def test_a_refit_with_state_dict_names_lands_whole_then_language_model_only(
    engine: dict[str, Any], processor: Any, hf_model: Any
) -> None:
    import copy

    generation, model = engine["generation"], copy.deepcopy(hf_model)
    batch = image_batch(processor, ROWS, seeds=[3, 4, 5])
    before = generation.generate(batch)

    whole = perturbed_state(model, seed=1, vision=True)
    assert any(n.startswith("model.visual.") for n in whole) and any(
        n.startswith("model.language_model.") for n in whole
    )
    refit(generation, whole)
    model.load_state_dict(whole)
    after = generation.generate(batch)
    assert not torch.equal(after["logprobs"], before["logprobs"]), "the refit changed nothing"
    assert_matches_hf(model, batch, after)

    # a frozen vision tower: only the language model is sent; the engine keeps the tower of the last refit
    language = {n: t for n, t in perturbed_state(model, seed=2, vision=False).items() if "visual" not in n}
    refit(generation, language)
    model.load_state_dict(language, strict=False)
    assert_matches_hf(model, batch, generation.generate(batch))


@pytest.mark.slow
def test_a_text_models_engine_refuses_an_image_batch(ray_session: None, tiny_model_dir: str, processor: Any) -> None:
    from rl_vllm.generation import VllmGeneration

    clusters = ClusterPool()
    generation = None
    try:
        config = generation_config(tiny_model_dir, limit_mm_per_prompt={"image": 1})  # a text model ignores it
        generation = VllmGeneration(clusters(1), config, name_prefix="text-vllm")
        assert generation.engine_info[0]["image_token_id"] is None
        batch = image_batch(processor, ROWS[:1], seeds=[3])
        with pytest.raises(ValueError, match="the batch has images, but the engine serves the text model") as err:
            generation.generate(batch)
        assert "\n" not in str(err.value)
    finally:
        if generation is not None:
            generation.shutdown()
        clusters.shutdown()


@pytest.mark.slow
def test_the_continuous_serving_engine_generates_for_image_groups(
    ray_session: None, vlm_dir: str, processor: Any, hf_model: Any
) -> None:
    """``async_engine``: the engine loop admits image requests; ``generate_groups_async`` + ``as_completed``
    hand back each sample group in the expanded frame, and so does a plain ``generate``."""
    from rl_vllm.generation import VllmGeneration

    clusters = ClusterPool()
    generation = None
    try:
        config = generation_config(vlm_dir, async_engine=True, limit_mm_per_prompt={"image": 2})
        generation = VllmGeneration(clusters(1), config, name_prefix="vlm-async-vllm")
        groups = [image_batch(processor, [ROWS[1], ROWS[1]], seeds=[7, 8]), image_batch(processor, ROWS, [3, 4, 5])]
        handles = generation.generate_groups_async(groups)
        done = dict(generation.as_completed(handles, timeout_s=300))
        assert sorted(done) == [0, 1]
        for index, group in enumerate(groups):
            assert_matches_hf(hf_model, group, done[index])
        assert_matches_hf(hf_model, groups[1], generation.generate(groups[1]))
    finally:
        if generation is not None:
            generation.shutdown()
        clusters.shutdown()
