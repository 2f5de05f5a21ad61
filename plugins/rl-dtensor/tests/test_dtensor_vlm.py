"""The dtensor backend trains and scores the tiny Qwen2.5-VL (docs/vision.md), on 2 Ray ranks (gloo, FSDP2 dp=2).

Image rows of different sizes, one row without an image (its rank runs the tower on a dummy image, or the
ranks would wait on each other), against a float64 single-process Hugging Face forward of one row at a time;
micro-batches padded (``plain``, ``dynamic``) or packed (``packing``: each rank packs its two rows, images and
all, into one row; single-process packing checks are in test_dtensor_vlm_packing.py).
Two policies share one cluster: ``trained`` (the whole model trains) and ``frozen``
(``policy.freeze_vision_tower``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re

import pytest
import torch
from dtensor_testlib import call_all, full_weights, max_abs_diff, policy_config, reset_weights, valid_diff

from rlcore.algorithms.loss_functions import NLLLoss
from rlcore.testing.vlm_batches import image_batch, load_reference_model, reference_logprobs, reference_sgd_step

TOL = 1e-5
LR = 0.5  # the testlib's SGD learning rate
GBS = 4
DYNAMIC = {"enabled": True, "train_mb_tokens": 160, "logprob_mb_tokens": 160, "sequence_length_round": 8}
PACKING = {"enabled": True, "train_mb_tokens": 160, "logprob_mb_tokens": 160}  # a rank's 2 rows: one packed row


@pytest.fixture(scope="module")
def vlm() -> str:
    from rlcore.models import resolve_model

    return resolve_model("tiny-qwen2.5-vl")


@pytest.fixture(scope="module")
def data(vlm):
    return image_batch(vlm)


@pytest.fixture(scope="module")
def oracle(vlm, data):
    """(initial float64 logprobs, the SGD step's loss, the weights after it)."""
    model = load_reference_model(vlm)
    initial = reference_logprobs(model, data)
    loss, weights = reference_sgd_step(model, data, NLLLoss(), LR)
    return initial, loss, weights


@pytest.fixture(scope="module")
def policies(ray_session, vlm):
    from rlcore.distributed import RayVirtualCluster
    from rlcore.models import load_vlm_processor
    from rlcore.policy import Policy

    tokenizer = load_vlm_processor(vlm).tokenizer
    cluster = RayVirtualCluster([2], max_colocated_worker_groups=2)
    started = {}
    for name, freeze in (("trained", False), ("frozen", True)):
        cfg = policy_config(
            vlm,
            train_global_batch_size=GBS,
            logprob_batch_size=1,  # the row without an image is a micro-batch of its own
            max_total_sequence_length=128,
            freeze_vision_tower=freeze,
        )
        started[name] = Policy(cluster, cfg, tokenizer, name_prefix=f"dt-vlm-{name}")
    yield started
    for policy in started.values():
        policy.shutdown()
    cluster.shutdown()


@contextlib.contextmanager
def batching(policy, mode: str):
    """The driver's batch plan with dynamic batching or packing (only the driver reads it; see
    dtensor_testlib.batching); ``plain`` leaves it as it is."""
    from rlcore.config import BatchPlan, DynamicBatchingConfig, SequencePackingConfig

    if mode == "plain":
        yield
        return
    original = policy.resolved
    update = (
        {"dynamic_batching": DynamicBatchingConfig.model_validate(DYNAMIC)}
        if mode == "dynamic"
        else {"sequence_packing": SequencePackingConfig.model_validate(PACKING)}
    )
    plan = BatchPlan.of(original.config.model_copy(update=update), original.batch.data_parallel_size, mode == "packing")
    assert plan.mode == mode
    policy.resolved = dataclasses.replace(original, batch=plan)
    try:
        yield
    finally:
        policy.resolved = original


def checkpoint_names(path: str) -> set[str]:
    from safetensors import safe_open

    with safe_open(f"{path}/model.safetensors", "pt") as f:
        return set(f.keys())


def test_batch_has_rows_with_and_without_images(data):
    patches = [int(p.shape[0]) for p in data["pixel_values"]]
    assert 0 in patches and len({p for p in patches if p}) == len([p for p in patches if p])  # sizes differ


def test_packing_packs_rows_with_images_together(vlm, data):
    """Each rank's packed micro-batch holds several rows, with images (else ``packing`` below tests nothing)."""
    from rlcore.config import BatchPlan

    cfg = policy_config(vlm, train_global_batch_size=GBS, max_total_sequence_length=128, sequence_packing=PACKING)
    plan = BatchPlan.of(cfg, 2, packing=True)
    shards, _ = data.shard_by_batch_size(2, batch_size=GBS, **plan.shard_args("train"))
    for shard in shards:
        mbs = list(shard.make_microbatch_iterator_for_packable_sequences())
        assert len(mbs) == 1 and mbs[0].size == 2 and sum(int(p.shape[0]) for p in mbs[0]["pixel_values"])


@pytest.mark.parametrize("mode", ["plain", "dynamic", "packing"])
def test_logprobs_match_float64_hf(policies, vlm, data, oracle, mode):
    policy = policies["trained"]
    reset_weights(policy, vlm)
    with batching(policy, mode):
        got = policy.get_logprobs(data)["logprobs"]
    diff = valid_diff(got, oracle[0].float(), data["input_lengths"])
    assert diff <= TOL, f"{mode}: logprobs differ from the float64 forward by {diff:.3g}"


def test_refit_sends_the_whole_model_under_checkpoint_names(policies, vlm):
    info = policies["trained"].prepare_refit_info()
    assert set(info) == checkpoint_names(vlm)
    assert any(name.startswith("visual.") for name in info)


@pytest.mark.parametrize("mode", ["plain", "dynamic", "packing"])
def test_one_sgd_step_matches_float64_step(policies, vlm, data, oracle, mode):
    _, loss, expected = oracle
    policy = policies["trained"]
    reset_weights(policy, vlm)
    with batching(policy, mode):
        out = policy.train(data, NLLLoss())
    assert abs(float(out["loss"][0]) - loss) <= TOL * max(1.0, abs(loss))
    weights = full_weights(policy)
    worst, name = max_abs_diff(weights, {k: v.float() for k, v in expected.items()})
    assert worst <= TOL, f"{name} differs from the float64 SGD step by {worst:.3g}"
    initial = load_reference_model(vlm, torch.float32).state_dict()
    assert not torch.equal(
        weights["model.visual.patch_embed.proj.weight"], initial["model.visual.patch_embed.proj.weight"]
    )


def test_frozen_tower_keeps_its_weights_and_stays_out_of_refit(policies, vlm, data):
    policy = policies["frozen"]
    info = policy.prepare_refit_info()
    assert set(info) == {n for n in checkpoint_names(vlm) if not n.startswith("visual.")}
    out = policy.train(data, NLLLoss())
    assert all(math.isfinite(float(loss)) for loss in out["loss"])
    after = full_weights(policy)
    initial = load_reference_model(vlm, torch.float32).state_dict()
    tower = [n for n in initial if n.startswith("model.visual.")]
    assert tower and all(torch.equal(after[n], initial[n]) for n in tower)
    assert not torch.equal(after["lm_head.weight"], initial["lm_head.weight"])
    optimized = set(call_all(policy, "optimized_parameter_names")[0])
    assert optimized and not optimized & set(tower)  # no optimizer state for the tower


@pytest.mark.parametrize(
    "key, settings",
    [
        ("policy.dtensor_cfg.tensor_parallel_size", dict(tp=2)),
        ("policy.lora.enabled", dict(lora={"enabled": True})),
        ("model_head='value' (a value model)", dict(model_head="value")),
    ],
)
def test_what_a_vlm_does_not_do_here_is_refused_naming_the_key(vlm, tiny_model_dir, key, settings):
    """The workers refuse what the config check refuses (the value head too, which is no config key), in its
    words."""
    from transformers import AutoConfig

    from rl_dtensor.checks import check_vision_settings, config_check
    from rl_dtensor.config import dtensor_section
    from rlcore.plugins import LayoutRequest

    settings = dict(settings)
    tp, head = settings.pop("tp", 1), settings.pop("model_head", "lm")
    cfg = policy_config(vlm, tp=tp, max_total_sequence_length=128, **settings)
    check_vision_settings(AutoConfig.from_pretrained(tiny_model_dir), cfg, tp, head)  # a text model: fine
    words = rf"^{re.escape(key)}: {re.escape(vlm)} is a vision-language model, and the dtensor backend does not "
    with pytest.raises(ValueError, match=words) as refused:
        check_vision_settings(AutoConfig.from_pretrained(vlm), cfg, tp, head)
    if head == "lm":
        request = LayoutRequest(cfg, dtensor_section(cfg, None), 2, False)
        assert config_check(request) == [str(refused.value)]


def test_a_vlm_packs_here(vlm):
    from transformers import AutoConfig

    from rl_dtensor.checks import check_vision_settings

    packing = {"enabled": True, "train_mb_tokens": 128}
    cfg = policy_config(vlm, max_total_sequence_length=128, sequence_packing=packing)
    check_vision_settings(AutoConfig.from_pretrained(vlm), cfg, 1, "lm")


def test_checkpoint_is_a_hugging_face_vlm_and_loads_back(policies, vlm, tmp_path):
    """``save_checkpoint`` writes the checkpoint's names (``visual.*``, ``model.layers.*``) that Hugging Face's
    image-text class loads, and ``load_checkpoint`` reads them back into the shards."""
    policy = policies["frozen"]
    before = full_weights(policy)
    policy.save_checkpoint(str(tmp_path / "weights"))
    assert checkpoint_names(str(tmp_path / "weights")) == checkpoint_names(vlm)
    loaded = load_reference_model(str(tmp_path / "weights"), torch.float32).state_dict()
    assert all(torch.equal(loaded[name], t) for name, t in before.items())
    reset_weights(policy, vlm)
    reset_weights(policy, str(tmp_path / "weights"))
    after = full_weights(policy)
    assert all(torch.equal(after[name], t) for name, t in before.items())


def test_dummy_image_changes_no_number_and_gives_the_tower_zero_gradients(vlm, data):
    """Single process: a micro-batch without images runs the tower on the dummy image (so sharded ranks stay in
    step), which leaves the logits as they are and gives every tower parameter a zero gradient, not none."""
    from rlcore.training.vision import VisionForward

    model = load_reference_model(vlm)
    row = data.slice(1, 2)  # the row without an image
    assert not row["pixel_values"][0].shape[0]
    ids = row["input_ids"][:, : int(row["input_lengths"][0])]
    plain = model(input_ids=ids).logits.detach()
    vision = VisionForward(model)
    logits = model(input_ids=ids, **vision.kwargs(ids, row)).logits
    assert torch.equal(logits.detach(), plain)
    logits.sum().backward()
    tower = [p for name, p in model.named_parameters() if name.startswith("model.visual.")]
    assert tower and all(p.grad is not None and not p.grad.any() for p in tower)
