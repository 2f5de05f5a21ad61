"""The dtensor backend against a single-process HF float32 model, on real Ray workers (gloo).

Two 2-rank policies of a tiny Llama: ``dp2`` (FSDP2 over dp=2, tp=1) and
``tp2`` (dp=1, tp=2 with sequence parallel). Both are compared with the same
oracle: logprobs and top-k of an HF forward, and one plain SGD step on the
whole batch. Tolerance 1e-5 everywhere (SGD: an update is ``lr * grad``, so
weight errors are gradient errors, not amplified as Adam's would be).
"""

from __future__ import annotations

import pytest
import torch
from dtensor_testlib import batch as make_data
from dtensor_testlib import (
    batching,
    call_all,
    full_weights,
    hf_logprobs,
    max_abs_diff,
    model_dir,
    oracle_step,
    policy_config,
    reset_weights,
    valid_diff,
)

from rlcore.algorithms.loss_functions import NLLLoss
from rlcore.testing.conformance import distillation_step, dpo_step

TOL = 1e-5
LAYOUTS = {"dp2": dict(tp=1), "tp2": dict(tp=2, sp=True)}


@pytest.fixture(scope="module")
def llama() -> str:
    return model_dir("llama")


@pytest.fixture(scope="module")
def data(tiny_tokenizer):
    return make_data(tiny_tokenizer)


@pytest.fixture(scope="module")
def oracle(llama, data):
    return oracle_step(llama, data, NLLLoss())


@pytest.fixture(scope="module")
def layouts(ray_session, llama, tiny_tokenizer):
    """``get(name) -> (policy, cluster)``, each started once for the module."""
    from rlcore.distributed import RayVirtualCluster
    from rlcore.policy import Policy

    started: dict = {}

    def get(name: str):
        if name not in started:
            # Room for a colocated receiver in the refit test.
            cluster = RayVirtualCluster([2], max_colocated_worker_groups=2)
            policy = Policy(cluster, policy_config(llama, **LAYOUTS[name]), tiny_tokenizer, name_prefix=f"dt-{name}")
            started[name] = (policy, cluster)
        return started[name]

    yield get
    for policy, cluster in started.values():
        policy.shutdown()
        cluster.shutdown()


@pytest.fixture(params=list(LAYOUTS))
def policy(request, layouts, llama):
    """A policy at the initial weights."""
    policy, _ = layouts(request.param)
    reset_weights(policy, llama)
    return policy


def test_layout_is_sharded_as_configured(layouts):
    """dp2: FSDP DTensors on the 1-D dp mesh; tp2: every weight on the 2-D (dp, tp) mesh."""
    dp2, _ = layouts("dp2")
    tp2, _ = layouts("tp2")
    assert set(call_all(dp2, "is_dtensor_model")[0].values()) == {1}
    assert set(call_all(tp2, "is_dtensor_model")[0].values()) == {2}
    infos = call_all(tp2, "get_gpu_info")
    assert [(i["dp"], i["tp"], i["tp_rank"]) for i in infos] == [(1, 2, 0), (1, 2, 1)]


@pytest.mark.parametrize("mode", ["plain", "dynamic", "packing"])
def test_logprobs_match_hf(policy, llama, data, mode):
    expected = hf_logprobs(llama, data)
    with batching(policy, mode):
        got = policy.get_logprobs(data)["logprobs"]
    assert valid_diff(got, expected, data["input_lengths"]) <= TOL


def test_logprobs_ignore_padding_tokens(policy, llama, data):
    """Random tokens in the padding change nothing: sequences end where input_lengths says."""
    noisy = data.copy()
    pad = torch.arange(data["input_ids"].shape[1])[None, :] >= data["input_lengths"][:, None]
    noise = torch.randint(3, 259, data["input_ids"].shape, generator=torch.Generator().manual_seed(5))
    noisy["input_ids"] = torch.where(pad, noise, data["input_ids"])
    got = policy.get_logprobs(noisy)["logprobs"]
    assert valid_diff(got, hf_logprobs(llama, data), data["input_lengths"]) <= TOL


@pytest.mark.parametrize("mode", ["plain", "packing"])
def test_topk_logits_are_global_and_match_hf(policy, llama, data, mode):
    from rlcore.testing.conformance import load_hf_model

    k = 5
    with batching(policy, mode):
        out = policy.get_topk_logits(data, k=k)
    values, indices = out["topk_logits"], out["topk_indices"]
    batch_size, seq = data["input_ids"].shape
    assert values.shape == indices.shape == (batch_size, seq - 1, k) and indices.dtype == torch.int64
    with torch.no_grad():
        valid = torch.arange(seq)[None, :] < data["input_lengths"][:, None]
        logits = load_hf_model(llama)(input_ids=data["input_ids"], attention_mask=valid.long()).logits[:, :-1]
    rows = torch.arange(seq - 1)[None, :] < (data["input_lengths"][:, None] - 1)
    assert float(((values - logits.topk(k, dim=-1).values).abs().amax(-1) * rows).max()) <= TOL
    at_indices = logits.gather(-1, indices.clamp(0, logits.shape[-1] - 1))
    assert float(((values - at_indices).abs().amax(-1) * rows).max()) <= TOL


def test_one_sgd_step_matches_single_process(policy, data, oracle):
    _, expected = oracle
    out = policy.train(data, NLLLoss())
    assert len(out["loss"]) == 1
    assert abs(float(out["loss"][0]) - expected.loss) <= TOL * max(1.0, abs(expected.loss))
    assert abs(float(out["grad_norm"][0]) - expected.grad_norm) <= TOL * expected.grad_norm
    worst, name = max_abs_diff(full_weights(policy), expected.weights)
    assert worst <= TOL, f"{name} differs from the single-process SGD step by {worst:.3g}"


@pytest.mark.parametrize("variant", [("plain", 2), ("plain", 4), ("dynamic", None), ("packing", None)])
def test_batching_does_not_change_the_step(policy, llama, data, oracle, variant):
    """Micro-batch size, dynamic batching and packing give the oracle's loss and weights (design.md §2.3)."""
    mode, mbs = variant
    _, expected = oracle
    with batching(policy, mode):
        out = policy.train(data, NLLLoss(), mbs=mbs)
    assert abs(float(out["loss"][0]) - expected.loss) <= TOL * max(1.0, abs(expected.loss))
    worst, name = max_abs_diff(full_weights(policy), expected.weights)
    assert worst <= TOL, f"{variant}: {name} differs by {worst:.3g}"


@pytest.fixture(scope="module")
def dpo_oracle(llama, data):
    """The kit's DPO step on this module's batch (reference: the initial model), and its single-process SGD step."""
    pairs, loss_fn = dpo_step(dict(data), hf_logprobs(llama, data))
    return pairs, loss_fn, oracle_step(llama, pairs, loss_fn)[1]


@pytest.mark.parametrize("mode", ["plain", "dynamic", "packing"])
def test_a_dpo_step_keeps_pairs_together_and_matches_single_process(policy, dpo_oracle, mode):
    """Pairs of uneven sequences stay in one micro-batch under dp and tp, with every batching mode."""
    pairs, loss_fn, expected = dpo_oracle
    with batching(policy, mode):
        out = policy.train(pairs, loss_fn)
    assert abs(float(out["loss"][0]) - expected.loss) <= TOL * max(1.0, abs(expected.loss))
    assert abs(float(out["grad_norm"][0]) - expected.grad_norm) <= TOL * expected.grad_norm
    worst, name = max_abs_diff(full_weights(policy), expected.weights)
    assert worst <= TOL, f"{mode}: {name} differs by {worst:.3g}"


@pytest.fixture(scope="module")
def distillation_oracle(llama, data, tiny_tokenizer):
    """The kit's distillation step on this module's batch, and its single-process SGD step."""
    batch, loss_fn = distillation_step(dict(data), tiny_tokenizer)
    return batch, loss_fn, oracle_step(llama, batch, loss_fn)[1]


@pytest.mark.parametrize("mode", ["plain", "packing"])
def test_a_distillation_step_reads_the_student_logits_at_the_teacher_ids(policy, distillation_oracle, mode):
    """The student's logits at the teacher's top-k ids, from a vocabulary split over tp (tp2) or whole (dp2),
    padded or packed: the step equals the single-process oracle's."""
    batch, loss_fn, expected = distillation_oracle
    with batching(policy, mode):
        out = policy.train(batch, loss_fn)
    assert abs(float(out["loss"][0]) - expected.loss) <= TOL * max(1.0, abs(expected.loss))
    assert abs(float(out["grad_norm"][0]) - expected.grad_norm) <= TOL * expected.grad_norm
    worst, name = max_abs_diff(full_weights(policy), expected.weights)
    assert worst <= TOL, f"{mode}: {name} differs by {worst:.3g}"


@pytest.fixture(scope="module")
def full_vocabulary_oracle(llama, data, tiny_tokenizer):
    """The kit's distillation step with ``zero_outside_topk`` (a share of its rows), which asks the backend for
    ``logprobs_at_indices`` and ``entropy``, and its single-process SGD step (the HF model's own inputs)."""
    batch, loss_fn = distillation_step(dict(data), tiny_tokenizer, full_vocabulary=True)
    assert {"logprobs_at_indices", "entropy"} <= set(loss_fn.inputs)
    return batch, loss_fn, oracle_step(llama, batch, loss_fn)[1]


def test_a_distillation_step_with_full_vocabulary_inputs_equals_the_oracle_s(policy, full_vocabulary_oracle):
    """The student's log-softmax at the teacher's ids and its entropy over the whole vocabulary, reduced over
    the tp-split vocabulary (tp2) or whole (dp2): the step equals the single-process oracle's."""
    batch, loss_fn, expected = full_vocabulary_oracle
    out = policy.train(batch, loss_fn)
    assert abs(float(out["loss"][0]) - expected.loss) <= TOL * max(1.0, abs(expected.loss))
    assert abs(float(out["grad_norm"][0]) - expected.grad_norm) <= TOL * expected.grad_norm
    worst, name = max_abs_diff(full_weights(policy), expected.weights)
    assert worst <= TOL, f"{name} differs by {worst:.3g}"


def test_reference_logprobs_are_the_initial_ones_after_training(policy, llama, data):
    initial = hf_logprobs(llama, data)
    for _ in range(2):
        policy.train(data, NLLLoss())
    trained = policy.get_logprobs(data)["logprobs"]
    assert float((trained - initial).abs().max()) > 1e-2, "training did not move the logprobs"
    checksums = call_all(policy, "parameter_checksum")
    reference = policy.get_reference_policy_logprobs(data)["reference_logprobs"]
    assert valid_diff(reference, initial, data["input_lengths"]) <= TOL
    assert call_all(policy, "parameter_checksum") == checksums, "the swap changed the trained weights"
    assert torch.equal(policy.get_logprobs(data)["logprobs"], trained)


def test_checkpoint_loads_with_from_pretrained(policy, data, tmp_path):
    from transformers import AutoTokenizer

    policy.train(data, NLLLoss())
    weights, tokenizer_dir = tmp_path / "weights", tmp_path / "tokenizer"
    policy.save_checkpoint(str(weights), None, str(tokenizer_dir))
    got = policy.get_logprobs(data)["logprobs"]
    assert valid_diff(got, hf_logprobs(str(weights), data), data["input_lengths"]) <= TOL
    assert AutoTokenizer.from_pretrained(str(tokenizer_dir)).pad_token_id == 0
    assert not list(tmp_path.glob(".*")), "temporary directories were left behind"


# -- refit export ------------------------------------------------------------------------------


def test_prepare_refit_info_describes_the_hf_state_dict(layouts, llama):
    from rlcore.testing.conformance import load_hf_model

    policy, _ = layouts("tp2")
    info = policy.prepare_refit_info()
    state = load_hf_model(llama).state_dict()
    assert list(info) == list(state)
    assert all(tuple(info[k][0]) == tuple(v.shape) and info[k][1] == "float32" for k, v in state.items())


@pytest.mark.parametrize("transport", ["shared_memory", "collective"])
def test_refit_transports_deliver_the_full_state_dict(layouts, data, transport):
    """The tensors received through each transport equal the full (gathered) model state dict."""
    from rlcore.distributed import RayVirtualCluster
    from rlcore.refit import WeightSynchronizer
    from tests.support.refit_fakes import RecordingGeneration

    policy, cluster = layouts("tp2")
    policy.train(data, NLLLoss())  # refit trained weights, not the ones on disk
    gen_cluster = cluster if transport == "shared_memory" else RayVirtualCluster([1])
    generation = RecordingGeneration(gen_cluster)
    try:
        sync = WeightSynchronizer(
            policy, generation, colocated=transport == "shared_memory", cluster=cluster, bucket_bytes=64 << 10
        )
        stats = sync.sync_weights()
        got = generation.received()
    finally:
        generation.shutdown()
        if gen_cluster is not cluster:
            gen_cluster.shutdown()
    expected = full_weights(policy)
    assert stats["bytes"] >= sum(t.numel() * 4 for t in expected.values())
    assert list(got) == list(expected)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
