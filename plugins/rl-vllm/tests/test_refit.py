"""Weight refit into real vLLM engines from a real training backend, on CPU.

One colocated placement for the whole module: a 2-bundle cluster with
``max_colocated_worker_groups=2`` holding two ``reference`` training ranks
and two engines (engine ``r`` shares bundle ``r`` with training rank ``r``).
The module runs once per training backend in ``TRAINING_BACKENDS`` that is
installed with a worker (rlcore's ``reference`` always is; ``dtensor`` once
its worker lands): train a step, refit through each transport, compare
logprobs. The failure cases are the receiver's own and run only against
``reference``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import ray
import torch

from rl_vllm.generation import VllmGeneration
from rl_vllm.refit import EngineStaleError
from rlcore.config import load_config_dict
from rlcore.data import BatchedDataDict
from rlcore.refit import RefitError, WeightSynchronizer
from rlcore.refit.shared_memory import stream_to_receiver
from rlcore.testing.conformance import generation_output_problems, load_hf_model
from rlcore.testing.models import make_batch
from rlcore.testing.pytest_plugin import ClusterPool

WORLD = 2
MAX_NEW = 6
ATOL = 1e-4
SMALL_BUCKET = 32 << 10  # many buckets for a tiny model, so streams really are multi-bucket


#: Training backends refit from. One that is not installed, or has no worker module yet, is skipped.
TRAINING_BACKENDS = ["reference", "dtensor"]


def _skip_unless_usable(backend: str) -> None:
    import importlib.util

    from rlcore.plugins import BackendError, get_registry

    try:
        spec = get_registry().resolve(backend, kind="training")
    except BackendError as exc:
        pytest.skip(str(exc))
    module = spec.worker_class.partition(":")[0]
    try:
        found = importlib.util.find_spec(module) is not None
    except ImportError:
        found = False
    if not found:
        pytest.skip(f"training backend '{backend}' has no worker module {module} yet")
    if "refit" not in spec.capabilities:
        pytest.skip(f"training backend '{backend}' does not declare 'refit'")


def reference_only(setup: dict) -> None:
    """Failure handling is the receiver's own: checked once, against the reference trainer."""
    if setup["backend"] != "reference":
        pytest.skip("receiver failure handling is checked with the reference backend only")


@pytest.fixture(scope="module", params=TRAINING_BACKENDS)
def setup(
    request: pytest.FixtureRequest, ray_session: None, tiny_model_dir: str, tiny_tokenizer: Any
) -> Iterator[dict]:
    from rlcore.policy import Policy

    backend = request.param
    _skip_unless_usable(backend)
    cfg = load_config_dict(
        {
            "cluster": {"workers_per_node": WORLD},
            "policy": {
                "backend": backend,
                "model_name": tiny_model_dir,
                "precision": "float32",
                "train_global_batch_size": 4,
                "train_micro_batch_size": 1,
                "max_total_sequence_length": 64,
                "optimizer": {"name": "torch.optim.SGD", "kwargs": {"lr": 0.5}},
                "max_grad_norm": None,
                "generation": {
                    "backend": "vllm",
                    "max_new_tokens": MAX_NEW,
                    "pad_token_id": tiny_tokenizer.pad_token_id,
                    "vllm_cfg": {"kv_cache_space_gb": 0.0625, "max_model_len": 128},
                },
            },
        }
    ).policy
    clusters = ClusterPool()
    cluster = clusters(WORLD, max_colocated_worker_groups=2)
    policy = generation = None
    try:
        policy = Policy(cluster, cfg, tiny_tokenizer, name_prefix=f"refit-{backend}", init_reference_model=False)
        generation = VllmGeneration(cluster, cfg.generation, name_prefix=f"refit-vllm-{backend}")
        yield {
            "backend": backend,
            "policy": policy,
            "generation": generation,
            "cluster": cluster,
            "tokenizer": tiny_tokenizer,
            "model_dir": tiny_model_dir,
        }
    finally:
        for owner in (generation, policy):
            if owner is not None:
                owner.shutdown()
        clusters.shutdown()


def train_one_step(policy: Any, tokenizer: Any, seed: int) -> None:
    from rlcore.algorithms.loss_functions import NLLLoss

    policy.train(BatchedDataDict(make_batch(tokenizer, 4, 5, 16, seed=seed)), NLLLoss())


def greedy(setup: dict, seed: int = 3) -> tuple[BatchedDataDict, BatchedDataDict]:
    raw = make_batch(setup["tokenizer"], 4, 3, 8, seed=seed)
    data = BatchedDataDict(input_ids=raw["input_ids"], input_lengths=raw["input_lengths"])
    out = setup["generation"].generate(data, greedy=True)
    problems = generation_output_problems(
        data["input_ids"], data["input_lengths"], out, MAX_NEW, setup["tokenizer"].pad_token_id
    )
    assert not problems, "\n".join(problems)
    return data, out


def logprob_error(setup: dict, data: BatchedDataDict, out: BatchedDataDict) -> tuple[float, float]:
    """Max |generation - policy| logprob over generated tokens, and token_mult_prob_error."""
    seqs = BatchedDataDict(input_ids=out["output_ids"], input_lengths=out["unpadded_sequence_lengths"])
    expected = setup["policy"].get_logprobs(seqs)["logprobs"]
    positions = torch.arange(out["output_ids"].shape[1])[None, :]
    mask = (positions >= data["input_lengths"][:, None]) & (positions < out["unpadded_sequence_lengths"][:, None])
    diff = (out["logprobs"] - expected)[mask]
    return float(diff.abs().max()), float(diff.exp().mean())


def assert_in_sync(setup: dict) -> None:
    data, out = greedy(setup)
    err, mult = logprob_error(setup, data, out)
    assert err <= ATOL, f"engine logprobs differ from the policy's by {err:.3g} after the refit"
    assert abs(mult - 1.0) <= ATOL, f"token_mult_prob_error {mult}"


def hf_weights(model_dir: str, scale: float = 1.0) -> dict[str, torch.Tensor]:
    return {k: v * scale for k, v in load_hf_model(model_dir).state_dict().items()}


# -- tests, in order: they share one policy and one pair of engines --------------------------------


def test_refit_info_is_checked_against_the_engine_model(setup: dict) -> None:
    reference_only(setup)
    generation = setup["generation"]
    info = setup["policy"].prepare_refit_info()
    name = next(n for n in info if n.endswith("q_proj.weight"))
    shape, dtype = info[name]
    with pytest.raises(RefitError, match=f"lacks 1 tensor.*{name}"):
        generation.prepare_refit_info({k: v for k, v in info.items() if k != name})
    with pytest.raises(RefitError, match="shape mismatch"):
        generation.prepare_refit_info({**info, name: ((shape[0] + 1, shape[1]), dtype)})
    with pytest.raises(RefitError, match="does not"):
        generation.prepare_refit_info({**info, "model.extra.weight": ((2,), "float32")})
    generation.prepare_refit_info(info)  # the real one is accepted
    greedy(setup)  # and the engines still serve


def check_bucket_plan(setup: dict, bucket_bytes: int) -> None:
    """The plan really is what the parameter stands for: layers split and copied, or whole and viewed."""
    from rlcore.refit.buckets import plan_buckets, split_layer_names

    plan = plan_buckets(setup["policy"].prepare_refit_info(), bucket_bytes)
    split = split_layer_names(plan)
    if bucket_bytes == SMALL_BUCKET:
        assert split, "every layer should be split over buckets"
    else:  # views only, and more buckets than buffers, so a buffer is reused while vLLM holds views
        assert not split and len(plan) > 2, (len(plan), sorted(split)[:3])


#: Holds any one layer of the tiny model but not two: buckets are cut between layers, nothing is copied.
LAYER_BUCKET = 200 << 10


@pytest.mark.parametrize("bucket_bytes", [SMALL_BUCKET, LAYER_BUCKET], ids=["split-layers", "whole-layers"])
def test_train_then_refit_by_shared_memory(setup: dict, bucket_bytes: int) -> None:
    """Train a step; after a shared-memory refit the engines' logprobs equal the policy's."""
    check_bucket_plan(setup, bucket_bytes)
    before_data, before = greedy(setup)
    train_one_step(setup["policy"], setup["tokenizer"], seed=100 + bucket_bytes % 7)
    err, _ = logprob_error(setup, before_data, before)
    assert err > 1e-3, "the training step did not change the policy: the refit test would be vacuous"
    sync = WeightSynchronizer(
        setup["policy"], setup["generation"], colocated=True, bucket_bytes=bucket_bytes, verify=True, weight_version=5
    )
    stats = sync.sync_weights()  # verified: every engine holds version 5 and the fingerprints its rank sent
    assert sync.transport == "shared_memory" and stats["bytes"] > 0 and stats["weight_version"] == 5
    assert stats["verified_tensors"] == len(setup["policy"].prepare_refit_info())
    assert_in_sync(setup)
    assert greedy(setup)[1]["weight_version"].tolist() == [5] * 4  # the samples carry the verified version


@pytest.mark.parametrize("bucket_bytes", [SMALL_BUCKET, LAYER_BUCKET], ids=["split-layers", "whole-layers"])
def test_train_then_refit_by_collective(setup: dict, bucket_bytes: int) -> None:
    """The same through the broadcast transport (gloo group of training rank 0 + both engines)."""
    check_bucket_plan(setup, bucket_bytes)
    train_one_step(setup["policy"], setup["tokenizer"], seed=200 + bucket_bytes % 7)
    sync = WeightSynchronizer(
        setup["policy"],
        setup["generation"],
        colocated=False,
        cluster=setup["cluster"],
        bucket_bytes=bucket_bytes,
        verify=True,
    )
    stats = sync.sync_weights()  # verified against training rank 0's fingerprints
    assert stats["weight_version"] == 0 and stats["verified_tensors"] == len(setup["policy"].prepare_refit_info())
    assert sync.transport == "collective"
    assert_in_sync(setup)
    train_one_step(setup["policy"], setup["tokenizer"], seed=201)
    assert sync.sync_weights()["weight_version"] == 1  # the group is reused; the next version, verified
    assert_in_sync(setup)


def test_an_engine_holding_other_bytes_than_were_sent_is_one_line(setup: dict) -> None:
    """Verified refit against the real engines' reports: engine 1 is fed one changed element of one tensor (its
    received bytes differ from what the trainer sent); the core's check names that engine and tensor."""
    from rlcore.refit.fingerprint import verify_engines

    reference_only(setup)
    generation = setup["generation"]
    info = setup["policy"].prepare_refit_info()
    generation.prepare_refit_info(info)
    weights = hf_weights(setup["model_dir"])
    name = next(n for n in info if n.endswith("mlp.down_proj.weight"))
    corrupted = {**weights, name: weights[name].clone()}
    corrupted[name].view(-1)[-1] += 1.0  # the last element: always sampled

    def stream(fed: list[dict[str, torch.Tensor]]) -> Any:
        endpoints, receivers = generation.refit_endpoints(), generation.update_weights_via_ipc_zmq()
        sent = [
            stream_to_receiver(((k, w[k]) for k in info), info, *endpoints[rank], SMALL_BUCKET, torch.device("cpu"))
            for rank, w in enumerate(fed)
        ]
        ray.get(receivers)
        generation.set_weight_version(9)
        return sent[0].fingerprints  # what the trainer sent: the true weights

    sent = stream([weights, weights])
    assert verify_engines(sent, generation.weight_fingerprints(), version=9) == 9
    sent = stream([weights, corrupted])
    with pytest.raises(RefitError) as err:
        verify_engines(sent, generation.weight_fingerprints(), version=9)
    line = str(err.value)
    print(line)
    assert "\n" not in line and "engine 1 holds fingerprint" in line and f"tensor '{name}'" in line
    with pytest.raises(RefitError, match="engine 0 holds weight_version 9, expected 10"):
        verify_engines(sent, generation.weight_fingerprints(), version=10)
    WeightSynchronizer(
        setup["policy"], generation, colocated=True, bucket_bytes=SMALL_BUCKET, verify=True
    ).sync_weights()  # the policy's weights back, verified
    assert_in_sync(setup)


def test_a_stream_missing_a_tensor_is_refused_and_changes_nothing(setup: dict) -> None:
    reference_only(setup)
    generation = setup["generation"]
    _, before = greedy(setup)
    info = setup["policy"].prepare_refit_info()
    generation.prepare_refit_info(info)
    weights = hf_weights(setup["model_dir"], scale=0.5)
    dropped = next(iter(info))
    partial = {k: v for k, v in info.items() if k != dropped}
    endpoints = generation.refit_endpoints()
    receivers = generation.update_weights_via_ipc_zmq()
    for rank in range(generation.num_engines):
        address, key = endpoints[rank]
        with pytest.raises(RefitError, match="missing 1 tensor"):
            stream_to_receiver(
                ((k, weights[k]) for k in partial), partial, address, key, SMALL_BUCKET, torch.device("cpu")
            )
    for ref in receivers:
        with pytest.raises(ray.exceptions.RayTaskError, match="missing 1 tensor"):
            ray.get(ref)
    _, after = greedy(setup)  # not stale, and the weights are the ones from before
    assert torch.equal(after["output_ids"], before["output_ids"])


def test_a_stream_broken_part_way_leaves_the_engines_stale_until_a_good_refit(setup: dict) -> None:
    reference_only(setup)
    generation = setup["generation"]
    info = setup["policy"].prepare_refit_info()
    generation.prepare_refit_info(info)
    weights = hf_weights(setup["model_dir"], scale=0.5)

    def breaks_half_way() -> Iterator[tuple[str, torch.Tensor]]:
        for i, name in enumerate(info):
            if i == len(info) // 2:
                raise RuntimeError("trainer died")
            yield name, weights[name]

    endpoints = generation.refit_endpoints()
    receivers = generation.update_weights_via_ipc_zmq()
    for rank in range(generation.num_engines):
        address, key = endpoints[rank]
        with pytest.raises(RuntimeError, match="trainer died"):
            stream_to_receiver(breaks_half_way(), info, address, key, SMALL_BUCKET, torch.device("cpu"))
    for ref in receivers:
        with pytest.raises(ray.exceptions.RayTaskError, match="RefitError"):
            ray.get(ref, timeout=120)
    with pytest.raises(EngineStaleError, match="failed part-way"):
        greedy(setup)
    with pytest.raises(EngineStaleError):  # still, until a refit succeeds
        greedy(setup)
    WeightSynchronizer(setup["policy"], generation, colocated=True, bucket_bytes=SMALL_BUCKET).sync_weights()
    assert_in_sync(setup)


def test_a_refit_queued_behind_requests_waits_for_them(setup: dict) -> None:
    """Async generation: requests submitted before a refit run wholly on the old weights and carry the old
    version; the refit lands after them, and a request submitted after it runs on the new weights."""
    policy, generation = setup["policy"], setup["generation"]
    sync = WeightSynchronizer(policy, generation, colocated=False, cluster=setup["cluster"])
    sync.sync_weights()
    generation.set_weight_version(10)
    data, old = greedy(setup)
    train_one_step(policy, setup["tokenizer"], seed=300)
    queued = [generation.generate_async(data, greedy=True) for _ in range(3)]
    sync.sync_weights()  # submitted while the three requests are queued on the engines
    generation.set_weight_version(11)
    after = generation.collect(generation.generate_async(data, greedy=True))
    for out in (generation.collect(handle) for handle in queued):
        assert out["weight_version"].tolist() == [10] * len(data["input_ids"])
        assert torch.equal(out["output_ids"], old["output_ids"]) and torch.equal(out["logprobs"], old["logprobs"]), (
            "a request queued before the refit saw some of the new weights"
        )
    assert after["weight_version"].tolist() == [11] * len(data["input_ids"])
    err, _ = logprob_error(setup, data, after)
    assert err <= ATOL, f"after the refit the engine's logprobs differ from the policy's by {err:.3g}"
    assert float((after["logprobs"] - old["logprobs"]).abs().max()) > 1e-3, "the step changed nothing: vacuous"
    generation.set_weight_version(0)
