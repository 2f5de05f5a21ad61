"""A vision-language run's prompts and rollouts carry each row's pixels (docs/vision.md): the expanded ids and
pixels are the model's processor's own, copies of a sample share them, every turn's request holds them, and the
training batch has them row for row. The config refuses a vision-language model on a backend without
``image_inputs``. The engine here is a stand-in: the orchestration is under test, not generation."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rlcore.datasets import Sample
from rlcore.models import load_vlm_processor, resolve_model
from rlcore.run.image_prompts import image_model_at
from rlcore.run.step import Timer, encode_samples, training_batch


@pytest.fixture(scope="module")
def vlm_path() -> str:
    return resolve_model("tiny-qwen2.5-vl")


def picture(width: int, height: int, shade: int):
    from PIL import Image

    return Image.new("RGB", (width, height), (shade, 255 - shade, 40))


def run_config(path: str, max_turns: int = 1) -> SimpleNamespace:
    return SimpleNamespace(
        policy=SimpleNamespace(
            tokenizer=SimpleNamespace(name=path, chat_template_kwargs=None), max_total_sequence_length=200
        ),
        data=SimpleNamespace(max_input_seq_length=None),
        algorithm_section=SimpleNamespace(max_rollout_turns=max_turns, seed=3),
    )


def samples() -> list[Sample]:
    two = [{"type": "image"}, {"type": "text", "text": "Count"}, {"type": "image"}]
    return [
        Sample(0, [{"role": "user", "content": two}], {"ground_truth": "2"}, [picture(56, 56, 9), picture(90, 60, 99)]),
        Sample(1, [{"role": "user", "content": "No picture."}], {"ground_truth": "0"}),
    ]


def test_prompts_are_the_processors_expansion_and_copies_share_their_pixels(vlm_path):
    processor = load_vlm_processor(vlm_path)
    batch = encode_samples(run_config(vlm_path), processor.tokenizer, samples(), repeat=2)
    assert batch.size == 4 and set(batch) >= {"pixel_values", "image_grid_thw", "images"}
    for row, sample in ((0, samples()[0]), (2, samples()[1])):
        text = processor.apply_chat_template(sample.messages, tokenize=False, add_generation_prompt=True)
        reference = processor(text=[text], images=sample.images or None, return_tensors="pt")
        length = int(batch["input_lengths"][row])
        assert batch["input_ids"][row, :length].tolist() == reference["input_ids"][0].tolist()
        if sample.images:
            torch.testing.assert_close(batch["pixel_values"][row], reference["pixel_values"], rtol=0, atol=0)
            assert batch["image_grid_thw"][row].tolist() == reference["image_grid_thw"].tolist()
    assert batch["pixel_values"][0] is batch["pixel_values"][1]  # a sample's copies: the same tensor, not copies
    model = image_model_at(vlm_path)
    assert model is not None
    assert batch["pixel_values"][2].shape == (0, model.patch_features) and batch["image_grid_thw"][3].shape == (0, 3)
    assert [len(images) for images in batch["images"]] == [2, 2, 0, 0]
    assert not batch["prompt_cut"].any()


@pytest.mark.parametrize("images", [0, 1])
def test_image_parts_and_images_must_agree_naming_the_row(vlm_path, images):
    processor = load_vlm_processor(vlm_path)
    content = [{"type": "image"}, {"type": "text", "text": "Count"}, {"type": "image"}]
    sample = Sample(5, [{"role": "user", "content": content}], {}, [picture(56, 56, 9)] * images)
    with pytest.raises(ValueError, match=rf"^data row 5: the messages show 2 image\(s\) .* the sample has {images}: "):
        encode_samples(run_config(vlm_path), processor.tokenizer, [sample], repeat=1)


def test_a_text_models_directory_is_no_image_model(tiny_model_dir):
    assert image_model_at(tiny_model_dir) is None


class TwoTurnEnvironment:
    """Answers every first turn with a user message, ends the episode on the second."""

    def step(self, logs, metadata):
        turn = [sum(m["role"] == "assistant" for m in log) for log in logs]
        return SimpleNamespace(
            observations=[{"role": "user", "content": "again"} for _ in logs],
            metadata=[None] * len(logs),
            next_stop_strings=[None] * len(logs),
            rewards=[float(t) for t in turn],
            terminateds=[t >= 2 for t in turn],
            reward_components=None,
            errors=[None] * len(logs),
        )


def test_every_turns_request_and_the_training_batch_keep_each_rows_pixels(vlm_path):
    from rlcore.run.rollouts import run_rollout

    processor = load_vlm_processor(vlm_path)
    cfg = run_config(vlm_path, max_turns=2)
    first = encode_samples(cfg, processor.tokenizer, samples(), repeat=2)
    requests = []

    def generate(batch):
        requests.append(batch)
        n, width = batch["input_ids"].shape
        new = torch.full((n, 3), 70 + len(requests))
        lengths = batch["input_lengths"]
        out = torch.cat([batch["input_ids"], torch.zeros(n, 3, dtype=torch.long)], dim=1)
        for row in range(n):
            out[row, int(lengths[row]) : int(lengths[row]) + 3] = new[row]
        return {
            "output_ids": out,
            "logprobs": torch.zeros(n, width + 3),
            "generation_lengths": torch.full((n,), 3),
            "unpadded_sequence_lengths": lengths + 3,
        }

    rollout = run_rollout(cfg, generate, TwoTurnEnvironment(), processor.tokenizer, samples(), 2, Timer())
    assert len(requests) == 2
    for request in requests:  # every turn's request: the prompts' pixels and images, row for row
        assert all(torch.equal(p, q) for p, q in zip(request["pixel_values"], first["pixel_values"]))
        assert request["pixel_values"][0] is requests[0]["pixel_values"][1]  # sent as made, never copied
        assert [len(i) for i in request["images"]] == [2, 2, 0, 0]
    # the second turn extends the expanded prompt: its image tokens are the first turn's, in place
    image_token = processor.image_token_id
    second = requests[1]
    for row in range(4):
        length = int(first["input_lengths"][row])
        assert second["input_ids"][row, :length].tolist() == first["input_ids"][row, :length].tolist()
        assert int((second["input_ids"][row] == image_token).sum()) == int(
            (first["input_ids"][row] == image_token).sum()
        )
    train = training_batch(rollout.data, torch.ones(4))
    assert [p is q for p, q in zip(train["pixel_values"], requests[0]["pixel_values"])] == [True] * 4
    assert [g.tolist() for g in train["image_grid_thw"]] == [g.tolist() for g in first["image_grid_thw"]]
    assert "images" not in train  # the trainer gets pixels, not pictures
    shard = train.select_indices([3, 0])  # a selection of rows takes their pixels along
    assert shard["pixel_values"][1] is train["pixel_values"][0]


def test_a_vision_language_model_needs_backends_that_take_images(vlm_path, tiny_model_dir):
    from rlcore.config import ConfigError, load_config_dict, resolve

    cfg = load_config_dict(
        {
            "policy": {"model_name": vlm_path, "backend": "reference", "generation": {"backend": "reference"}},
            "cluster": {"workers_per_node": 1},
        }
    )
    with pytest.raises(ConfigError, match=r"policy.backend: .* is a vision-language model, and the training "):
        resolve(cfg)
    text = load_config_dict({"policy": {"model_name": tiny_model_dir, "freeze_vision_tower": True}})
    with pytest.raises(ConfigError, match=r"policy.freeze_vision_tower: .* is a text model"):
        resolve(text)


def test_a_completion_that_writes_an_image_placeholder_ends_before_it(vlm_path):
    """A sampled <|image_pad|> would make the trainer's forward look for pixels that do not exist: the completion
    ends before it (truncated), and the rollout counts such cuts."""
    from rlcore.run.rollouts import run_rollout

    processor = load_vlm_processor(vlm_path)
    pad = processor.image_token_id

    def generate(batch):
        n, width = batch["input_ids"].shape
        lengths = batch["input_lengths"]
        out = torch.cat([batch["input_ids"], torch.zeros(n, 3, dtype=torch.long)], dim=1)
        for row in range(n):
            out[row, int(lengths[row]) : int(lengths[row]) + 3] = torch.tensor([70, pad if row == 1 else 71, 72])
        logprobs = torch.cat([torch.zeros(n, width), torch.tensor([[-1.0, -2.0, -3.0]] * n)], dim=1)
        return {
            "output_ids": out,
            "logprobs": logprobs,
            "generation_lengths": torch.full((n,), 3),
            "unpadded_sequence_lengths": lengths + 3,
        }

    rollout = run_rollout(
        run_config(vlm_path), generate, TwoTurnEnvironment(), processor.tokenizer, samples(), 2, Timer()
    )
    data = rollout.data
    assert data["generation_lengths"].tolist() == [3, 1, 3, 3]
    assert data["truncated"].tolist() == [False, True, False, False]
    length = int(data["unpadded_sequence_lengths"][1])
    assert data["output_ids"][1, length - 1] == 70 and pad not in data["output_ids"][1, int(data["input_lengths"][1]) :]
    assert data["logprobs"][1, length - 1] == -1.0 and data["token_mask"][1].sum() == 1
    assert rollout.metrics["image_placeholder_cuts"] == 1.0


@pytest.mark.parametrize(
    "override, refused",
    [
        ("policy.dtensor_cfg.tensor_parallel_size=2", "policy.dtensor_cfg.tensor_parallel_size: .* dtensor backend"),
        ("policy.lora.enabled=true", "policy.lora.enabled: .* dtensor backend"),
        (
            "policy.backend=fsdp1 policy.dtensor_cfg.enabled=false policy.lora.enabled=true",
            "policy.lora.enabled: .* fsdp1",
        ),
        (  # dtensor packs image rows (docs/vision.md); fsdp1 packs no rows
            "policy.backend=fsdp1 policy.dtensor_cfg.enabled=false policy.sequence_packing.enabled=true",
            "policy.sequence_packing.enabled: the 'fsdp1' training backend does not declare",
        ),
        ("policy.tokenizer.chat_template=null", "policy.tokenizer.chat_template: is null"),
    ],
)
def test_what_a_vlm_run_cannot_use_is_refused_before_anything_starts(override, refused):
    import re

    from rlcore.config import ConfigError, load_config, resolve
    from rlcore.examples import example_path

    untrained = ["policy.warm_start=null", "policy.model_name=tiny-qwen2.5-vl"]  # the example without its SFT
    with pytest.raises(ConfigError) as caught:
        resolve(load_config(example_path("grpo_vlm_tiny"), [*untrained, *override.split()]), run=True)
    assert [p for p in caught.value.problems if re.match(refused, p)], caught.value.problems


def test_rollouts_a_checkpoint_carries_keep_each_rows_pixels(tmp_path):
    """Async GRPO saves the rollouts generated ahead with its checkpoint: a row's pixels come back with it."""
    from rlcore.data import BatchedDataDict
    from rlcore.run.checkpoints import load_rollouts, save_rollouts
    from rlcore.run.rollouts import Rollout

    pixels = [torch.randn(4, 6), torch.zeros(0, 6)] + [torch.randn(k, 6) for k in range(1, 11)]  # 12 rows
    grids = [torch.tensor([[1, 2, 2]])] * 12  # one tensor shared by all rows, as a prompt's copies share theirs
    data = BatchedDataDict(output_ids=torch.arange(24).view(12, 2), pixel_values=pixels, image_grid_thw=grids)
    save_rollouts(tmp_path / "rollouts", {3: Rollout(data, torch.ones(12), {"m": 1.0})})
    back = load_rollouts(tmp_path)[3]
    assert torch.equal(back.data["output_ids"], data["output_ids"])
    assert [p.shape for p in back.data["pixel_values"]] == [p.shape for p in pixels]  # row 10 after row 9
    assert all(torch.equal(a, b) for a, b in zip(back.data["pixel_values"], pixels))
    assert len(back.data["image_grid_thw"]) == 12 and back.data["image_grid_thw"][0] is back.data["image_grid_thw"][11]


def test_a_checkpoints_tokenizer_keeps_the_image_processor(vlm_path, tmp_path):
    """A checkpoint's tokenizer directory carries the processor's files, so a run warm-started from it (model:
    the checkpoint's weights, tokenizer: its tokenizer) makes the same image prompts."""
    from transformers import AutoTokenizer

    from rlcore.training.checkpoint import save_tokenizer

    save_tokenizer(AutoTokenizer.from_pretrained(vlm_path), tmp_path / "tokenizer")
    assert (tmp_path / "tokenizer" / "preprocessor_config.json").is_file()
    model, original = image_model_at(vlm_path, str(tmp_path / "tokenizer")), image_model_at(vlm_path)
    assert model is not None and original is not None
    assert model.image_processor.to_dict() == original.image_processor.to_dict()
    assert image_model_at(str(tmp_path / "tokenizer")) is None  # a tokenizer's directory says nothing of the model
