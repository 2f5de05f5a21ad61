"""The fsdp1 backend trains and scores the tiny Qwen2.5-VL (docs/vision.md), on 2 Ray ranks (gloo, FSDP1 dp=2).

Image rows of different sizes and one row without an image (its rank runs the tower on a dummy image, or the
ranks would wait on each other in the tower's FSDP units), against a float64 single-process Hugging Face
forward of one row at a time. Two policies share one cluster: ``trained`` (the whole model trains) and
``frozen`` (``policy.freeze_vision_tower``: the tower is an FSDP unit of its own, all frozen).
"""

from __future__ import annotations

import math

import pytest
import torch

from rlcore.algorithms.loss_functions import NLLLoss
from rlcore.config import load_config_dict
from rlcore.testing.vlm_batches import image_batch, load_reference_model, reference_logprobs, reference_sgd_step
from rlcore.training.hf_names import CheckpointNames

TOL = 1e-5
LR = 0.5
TOWER = "visual."  # the tower's checkpoint names
NEW_TOKENS = 4


@pytest.fixture(scope="module")
def vlm() -> str:
    from rlcore.models import resolve_model

    return resolve_model("tiny-qwen2.5-vl")


@pytest.fixture(scope="module")
def data(vlm):
    return image_batch(vlm)


@pytest.fixture(scope="module")
def initial(vlm) -> dict[str, torch.Tensor]:
    """The checkpoint's float32 tensors under their checkpoint names."""
    model = load_reference_model(vlm, torch.float32)
    return {name: t.clone() for name, t in CheckpointNames(model).tensors(model.state_dict().items())}


@pytest.fixture(scope="module")
def oracle(vlm, data):
    """(initial float64 logprobs, the SGD step's loss, the weights after it under checkpoint names)."""
    model = load_reference_model(vlm)
    logprobs = reference_logprobs(model, data)
    loss, weights = reference_sgd_step(model, data, NLLLoss(), LR)
    return logprobs, loss, dict(CheckpointNames(model).tensors(weights.items()))


def policy_config(model: str, freeze: bool):
    raw = {
        "backend": "fsdp1",
        "model_name": model,
        "train_global_batch_size": 4,
        "train_micro_batch_size": 1,
        "logprob_batch_size": 1,  # the row without an image is a micro-batch of its own
        "max_total_sequence_length": 128,
        "max_grad_norm": None,
        "optimizer": {"name": "torch.optim.SGD", "kwargs": {"lr": LR}},
        "freeze_vision_tower": freeze,
        "generation": {"max_new_tokens": NEW_TOKENS, "temperature": 1.0},
    }
    return load_config_dict({"cluster": {"workers_per_node": 2}, "policy": raw}).policy


@pytest.fixture(scope="module")
def policies(ray_session, vlm):
    from rlcore.distributed import RayVirtualCluster
    from rlcore.models import load_vlm_processor
    from rlcore.policy import Policy

    tokenizer = load_vlm_processor(vlm).tokenizer
    cluster = RayVirtualCluster([2], max_colocated_worker_groups=2)
    started = {
        name: Policy(cluster, policy_config(vlm, freeze), tokenizer, name_prefix=f"f1-vlm-{name}")
        for name, freeze in (("trained", False), ("frozen", True))
    }
    yield started
    for policy in started.values():
        policy.shutdown()
    cluster.shutdown()


def full_state(policy) -> dict[str, torch.Tensor]:
    return policy._all("export_full_state_dict")[0]


def valid_diff(got: torch.Tensor, expected: torch.Tensor, lengths: torch.Tensor) -> float:
    valid = torch.arange(got.shape[1])[None, :] < lengths[:, None]
    assert got.dtype == torch.float32 and (got[:, 0] == 0).all() and (got[~valid] == 0).all()
    return float((got.double() - expected).abs().max())


def test_logprobs_match_float64_hf(policies, vlm, data, oracle):
    policy = policies["trained"]
    policy._all("load_checkpoint", vlm)  # through transformers' loader: the files say visual.*, model.layers.*
    diff = valid_diff(policy.get_logprobs(data)["logprobs"], oracle[0], data["input_lengths"])
    assert diff <= TOL, f"logprobs differ from the float64 forward by {diff:.3g}"


def test_refit_sends_the_whole_model_under_checkpoint_names(policies, initial):
    info = policies["trained"].prepare_refit_info()
    assert set(info) == set(initial)
    assert all(info[name][0] == tuple(t.shape) for name, t in initial.items())


def test_one_sgd_step_matches_float64_step(policies, vlm, data, oracle, initial):
    _, loss, expected = oracle
    policy = policies["trained"]
    policy._all("load_checkpoint", vlm)
    out = policy.train(data, NLLLoss())
    assert abs(float(out["loss"][0]) - loss) <= TOL * max(1.0, abs(loss))
    after = full_state(policy)
    assert set(after) == set(expected)
    worst, name = max(((after[k].double() - expected[k]).abs().max().item(), k) for k in expected)
    assert worst <= TOL, f"{name} differs from the float64 SGD step by {worst:.3g}"
    assert not torch.equal(after["visual.patch_embed.proj.weight"], initial["visual.patch_embed.proj.weight"])


def test_frozen_tower_keeps_its_weights_and_stays_out_of_refit(policies, data, initial):
    policy = policies["frozen"]
    assert set(policy.prepare_refit_info()) == {n for n in initial if not n.startswith(TOWER)}
    out = policy.train(data, NLLLoss())
    assert all(math.isfinite(float(loss)) for loss in out["loss"])
    after = full_state(policy)
    tower = [n for n in initial if n.startswith(TOWER)]
    assert tower and all(torch.equal(after[n], initial[n]) for n in tower)
    assert not torch.equal(after["lm_head.weight"], initial["lm_head.weight"])
    optimized = policy._all("optimized_parameter_names")[0]
    assert optimized and not [n for n in optimized if ".visual." in n]  # no optimizer state for the tower


def prompts_of(data):
    """The batch's prompts (each row up to its response), with the rows' images."""
    from rlcore.data import BatchedDataDict

    lengths = data["token_mask"].argmax(dim=1)  # the first response token
    keys = ("pixel_values", "image_grid_thw")
    return BatchedDataDict(input_ids=data["input_ids"].clone(), input_lengths=lengths, **{k: data[k] for k in keys})


def test_greedy_generate_with_images_matches_hf(policies, vlm, data):
    """fsdp1's own generate takes image rows: ``output_ids`` in the expanded frame, the tokens HF's greedy
    ``generate`` of one row at a time picks, and logprobs that ``get_logprobs`` of the output repeats."""
    from transformers import GenerationConfig

    from rlcore.data import BatchedDataDict

    policy = policies["trained"]
    policy._all("load_checkpoint", vlm)
    prompts = prompts_of(data)
    out = policy.generate(prompts, greedy=True)
    model = load_reference_model(vlm, torch.float32)
    settings = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=2, pad_token_id=0)
    for b, length in enumerate(prompts["input_lengths"].tolist()):
        ids = prompts["input_ids"][b : b + 1, :length]
        kwargs = {"mm_token_type_ids": (ids == model.config.image_token_id).int()}
        if prompts["pixel_values"][b].shape[0]:
            kwargs |= {"pixel_values": prompts["pixel_values"][b], "image_grid_thw": prompts["image_grid_thw"][b]}
        expected = model.generate(input_ids=ids, generation_config=settings, **kwargs)[0, length:]
        n = int(out["generation_lengths"][b])
        assert torch.equal(out["output_ids"][b, :length], ids[0])
        assert out["output_ids"][b, length : length + n].tolist() == expected[:n].tolist(), f"row {b}"
    scored = BatchedDataDict(
        input_ids=out["output_ids"],
        input_lengths=out["unpadded_sequence_lengths"],
        pixel_values=prompts["pixel_values"],
        image_grid_thw=prompts["image_grid_thw"],
    )
    relogged = policy.get_logprobs(scored)["logprobs"]
    generated = out["logprobs"] != 0
    assert generated.any() and float((relogged - out["logprobs"])[generated].abs().max()) <= 1e-4


def test_checkpoint_is_a_hugging_face_vlm_and_loads_back(policies, vlm, tmp_path):
    """``save_checkpoint`` writes the checkpoint's names that Hugging Face's image-text class loads, and
    ``load_checkpoint`` reads them back into the flat shards."""
    policy = policies["frozen"]
    before = full_state(policy)
    policy.save_checkpoint(str(tmp_path / "weights"))
    model = load_reference_model(str(tmp_path / "weights"), torch.float32)
    loaded = dict(CheckpointNames(model).tensors(model.state_dict().items()))
    assert set(loaded) == set(before) and all(torch.equal(loaded[name], t) for name, t in before.items())
    policy._all("load_checkpoint", vlm)
    policy._all("load_checkpoint", str(tmp_path / "weights"))
    after = full_state(policy)
    assert all(torch.equal(after[name], t) for name, t in before.items())
