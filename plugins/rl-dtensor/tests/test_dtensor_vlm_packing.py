"""Sequence packing of the tiny Qwen2.5-VL, single process: the dtensor worker's own input functions
(:func:`rl_dtensor.inputs.packed_inputs`, :func:`rl_dtensor.inputs.forward_kwargs`) and the Hugging Face model.

Rows with 0, 1 and 2 images of different sizes and lengths go into one packed row. Its 3D rotary positions must be,
sequence by sequence, what the model's ``get_rope_index`` gives each row alone, and its logprobs those of a float64
forward of one row at a time, in which the model derives its positions itself. The workers on 2 ranks are in
test_dtensor_vlm.py (``mode="packing"``).
"""

from __future__ import annotations

import pytest
import torch

from rlcore.testing.vlm_batches import image_batch, load_reference_model, reference_logprobs

EPS32 = torch.finfo(torch.float32).eps  # the worker's logprobs are float32 (the model runs in float64 here)


@pytest.fixture(scope="module")
def vlm() -> str:
    from rlcore.models import resolve_model

    return resolve_model("tiny-qwen2.5-vl")


@pytest.fixture(scope="module")
def data(vlm):
    return image_batch(vlm)


@pytest.fixture(scope="module")
def oracle(vlm, data):
    return reference_logprobs(load_reference_model(vlm), data)


def _packed_logprobs(model, data, attn: str) -> torch.Tensor:
    from rl_dtensor.inputs import forward_kwargs, packed_inputs
    from rlcore.training.vision import VisionForward

    inputs = packed_inputs(data, torch.device("cpu"), attn, torch.float64, multiple=8)  # a padding segment too
    with torch.no_grad():
        logits = model(**forward_kwargs(inputs, data, VisionForward(model, packing=True))).logits
    return inputs.logprobs(logits).double()


def test_the_batch_packs_rows_with_zero_one_and_two_images_of_different_lengths(data):
    images = [int(g.shape[0]) for g in data["image_grid_thw"]]
    assert {0, 1, 2} <= set(images)
    assert len(set(data["input_lengths"].tolist())) == len(images)


def test_packed_positions_are_each_rows_own(vlm, data):
    from rl_dtensor.inputs import packed_inputs
    from rlcore.training.vision import VisionForward

    model = load_reference_model(vlm)
    inputs = packed_inputs(data, torch.device("cpu"), "sdpa", torch.float64, multiple=8)
    positions = VisionForward(model, packing=True).packed_position_ids(data, inputs.position_ids)
    width = inputs.input_ids.shape[1]
    assert positions.shape == (4, 1, width)
    assert torch.equal(positions[0], inputs.position_ids)  # the text row: restarts per sequence
    starts = inputs.packed.cu_seqlens.tolist()
    image_token = model.config.image_token_id
    for b, length in enumerate(data["input_lengths"].tolist()):
        ids = data["input_ids"][b : b + 1, :length]
        grid = data["image_grid_thw"][b] if data["image_grid_thw"][b].shape[0] else None
        own, _ = model.model.get_rope_index(ids, (ids == image_token).int(), image_grid_thw=grid)
        assert torch.equal(positions[1:, 0, starts[b] : starts[b] + length], own[:, 0])
        if grid is not None:  # an image's tokens share positions: fewer than the tokens
            assert int(own.max()) < length - 1
    tail = positions[1:, 0, starts[-1] :]
    assert tail.shape[1] and torch.equal(tail, inputs.position_ids[0, starts[-1] :].expand(3, -1))


@pytest.mark.parametrize("attn", ["sdpa", "eager", "segment"])
def test_packed_logprobs_match_one_row_at_a_time(vlm, data, oracle, attn):
    """sdpa and eager: the block-causal mask; segment: rl_dtensor's per-sequence attention (its segment bounds
    are the text row's: the vision tower's attention must not split its patches by them)."""
    from rl_dtensor.segment_attention import NAME, use_segment_attention

    model = load_reference_model(vlm)
    if attn == "segment":
        assert use_segment_attention(model)
        attn = NAME
    else:
        model.set_attn_implementation(attn)
    got = _packed_logprobs(model, data, attn)
    lengths = data["input_lengths"]
    valid = torch.arange(got.shape[1])[None, :] < lengths[:, None]
    ulps = ((got - oracle).abs() / (EPS32 * oracle.abs().clamp_min(1.0)))[valid]
    assert float(ulps.max()) <= 2, f"{attn}: packed logprobs differ from the one-row forwards by {ulps.max():.3g} ulps"
    assert not got[~valid].any()


def test_a_model_without_get_rope_index_is_refused_for_packing(vlm):
    from rlcore.training.vision import VisionForward

    model = load_reference_model(vlm)
    rope = model.model
    type(rope).get_rope_index, original = None, type(rope).get_rope_index  # a VLM class without it
    try:
        VisionForward(model)  # padded micro-batches need none
        with pytest.raises(ValueError, match=r"^policy\.sequence_packing\.enabled: .*; set policy"):
            VisionForward(model, packing=True)
    finally:
        type(rope).get_rope_index = original
