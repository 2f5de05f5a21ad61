"""Tensor and pipeline parallelism through ``rlcore.policy.Policy`` (real Ray workers, gloo, CPU).

Two layouts, each one module-scoped policy:

- ``tp2``: Qwen3 (q/k norms: their gradients must be summed across TP) with tied
  embeddings at TP=2 (untied TP=2 is in test_megatron_checkpoint / _refit).
- ``pp2``: Qwen2 (QKV bias) with *tied* embeddings, 3 layers split 2 + 1 over
  PP=2 (``num_layers_in_first/last_pipeline_stage``), activation checkpointing on.

Each is compared with a single-process HF float32 model: logprobs, top-k, and
one SGD step (loss, gradient norm, updated weights read back from the HF
checkpoint the policy saves); its megatron checkpoint is then loaded into a
1-rank policy (resharding TP/PP) and must give the same logprobs. Data-parallel
equivalence (dp=2 == dp=1) is the conformance kit's 'world' vs 'single' check.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from megatron_helpers import (
    SGD_LR,
    batch,
    call_workers,
    hf_logits,
    hf_logprobs,
    max_valid_diff,
    model_dir,
    policy_config,
    state_of,
)

from rlcore.testing.conformance import distillation_step, dpo_step, single_process_sgd, weight_problems

pytest_plugins = ["rlcore.testing.pytest_plugin"]
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

ATOL = 1e-5
LAYOUTS = {
    "tp2": dict(arch="qwen3", tied=True, layers=2, megatron={"tensor_model_parallel_size": 2}),
    # policy.logprob_chunk_size over a vocabulary split across the two ranks: 3 positions per chunk
    "tp2-chunked": dict(
        arch="qwen3", tied=True, layers=2, megatron={"tensor_model_parallel_size": 2}, policy={"logprob_chunk_size": 3}
    ),
    "pp2": dict(
        arch="qwen2",
        tied=True,
        layers=3,
        megatron={
            "pipeline_model_parallel_size": 2,
            "num_layers_in_first_pipeline_stage": 2,
            "num_layers_in_last_pipeline_stage": 1,
            "activation_checkpointing": True,
        },
    ),
}
TOPK = 5


@pytest.fixture(scope="module")
def pool(ray_session: None) -> Any:
    from rlcore.testing.pytest_plugin import ClusterPool

    clusters = ClusterPool()
    yield clusters
    clusters.shutdown()


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def started(request: pytest.FixtureRequest, pool: Any, tiny_tokenizer: Any) -> Any:
    """The layout's 2-rank policy, and what it computes before any training."""
    from rlcore.policy import Policy

    spec = LAYOUTS[request.param]
    path = model_dir(spec["arch"], spec["tied"], spec["layers"])
    data = batch(tiny_tokenizer)
    noisy = data.copy()
    pad = torch.arange(data["input_ids"].shape[1])[None, :] >= data["input_lengths"][:, None]
    noisy["input_ids"] = torch.where(
        pad, torch.randint(3, 259, pad.shape, generator=torch.Generator().manual_seed(5)), data["input_ids"]
    )
    policy = Policy(
        pool(2),
        policy_config(path, 2, megatron=spec["megatron"], **spec.get("policy", {})),
        tiny_tokenizer,
        name_prefix=f"parallel-{request.param}",
    )
    record = {
        "name": request.param,
        "policy": policy,
        "model": path,
        "batch": data,
        "logprobs": policy.get_logprobs(data)["logprobs"],
        "noisy_logprobs": policy.get_logprobs(noisy)["logprobs"],
        "topk": policy.get_topk_logits(data, k=TOPK),
    }
    yield record
    policy.shutdown()


@pytest.fixture(scope="module")
def trained(started: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One NLL step with plain SGD, then an HF + megatron checkpoint."""
    from rlcore.algorithms.loss_functions import NLLLoss

    policy = started["policy"]
    result = policy.train(started["batch"], NLLLoss())
    root = tmp_path_factory.mktemp(f"trained-{started['name']}")
    policy.save_checkpoint(str(root / "weights"), str(root / "megatron"))
    return {
        "result": result,
        "weights": str(root / "weights"),
        "megatron": str(root / "megatron"),
        "logprobs": policy.get_logprobs(started["batch"])["logprobs"],
    }


def test_logprobs_match_hf(started: dict) -> None:
    expected = hf_logprobs(started["model"], started["batch"])
    lengths = started["batch"]["input_lengths"]
    for key in ("logprobs", "noisy_logprobs"):
        got = started[key]
        assert got.dtype == torch.float32 and got.shape == expected.shape
        assert max_valid_diff(got, expected, lengths) <= ATOL, key
        positions = torch.arange(got.shape[1])[None, :]
        assert (got[:, 0] == 0).all() and (got[positions >= lengths[:, None]] == 0).all()


def test_topk_matches_hf(started: dict) -> None:
    logits = hf_logits(started["model"], started["batch"])[:, :-1]
    values, indices = started["topk"]["topk_logits"], started["topk"]["topk_indices"]
    assert values.shape == indices.shape == (*logits.shape[:2], TOPK) and indices.dtype == torch.int64
    rows = torch.arange(logits.shape[1])[None, :] < (started["batch"]["input_lengths"][:, None] - 1)
    assert float(((values - logits.topk(TOPK, dim=-1).values).abs().amax(-1) * rows).max()) <= ATOL
    assert float(((values - logits.gather(-1, indices)).abs().amax(-1) * rows).max()) <= ATOL


def test_train_step_matches_single_process_sgd(started: dict, trained: dict) -> None:
    from rlcore.algorithms.loss_functions import NLLLoss

    initial, (expected,) = single_process_sgd(started["model"], [(started["batch"], NLLLoss())], SGD_LR)
    loss, grad_norm = float(trained["result"]["loss"][0]), float(trained["result"]["grad_norm"][0])
    assert abs(loss - expected.loss) <= ATOL * abs(expected.loss), (loss, expected.loss)
    assert abs(grad_norm - expected.grad_norm) <= ATOL * expected.grad_norm, (grad_norm, expected.grad_norm)
    problems = weight_problems(state_of(trained["weights"]), expected.weights, initial, ATOL)
    assert not problems, "\n".join(problems)


def test_refit_export_is_the_hf_state_in_refit_info_order(started: dict, trained: dict) -> None:
    policy = started["policy"]
    info = policy.prepare_refit_info()
    exported = call_workers(policy, "hf_state_dict")[0]  # global rank 0
    assert list(exported) == list(info), "iter_refit_tensors must follow prepare_refit_info's order"
    saved = state_of(trained["weights"])
    for name, (shape, dtype) in info.items():
        assert tuple(exported[name].shape) == tuple(shape) and str(exported[name].dtype) == f"torch.{dtype}", name
        assert torch.equal(exported[name], saved[name]), name
    assert "lm_head.weight" not in info  # both layouts are tied: the receiver ties it to model.embed_tokens.weight


def test_checkpoint_reshards_to_a_single_rank(started: dict, trained: dict, pool: Any, tiny_tokenizer: Any) -> None:
    """The megatron checkpoint saved by 2 ranks (TP=2 or PP=2) loads into TP=1, PP=1."""
    from rlcore.policy import Policy

    assert (trained["logprobs"] - started["logprobs"]).abs().max() > 1e-3, "training must move the logprobs"
    single = Policy(
        pool(1),
        policy_config(started["model"], 1),
        tiny_tokenizer,
        name_prefix=f"resharded-{started['name']}",
        optimizer_path=trained["megatron"],
        init_reference_model=False,
    )
    try:
        got = single.get_logprobs(started["batch"])["logprobs"]
    finally:
        single.shutdown()
    assert max_valid_diff(got, trained["logprobs"], started["batch"]["input_lengths"]) <= ATOL


def test_reference_model_is_the_initial_model(started: dict, trained: dict) -> None:
    reference = started["policy"].get_reference_policy_logprobs(started["batch"])["reference_logprobs"]
    assert max_valid_diff(reference, started["logprobs"], started["batch"]["input_lengths"]) <= ATOL
    after = started["policy"].get_logprobs(started["batch"])["logprobs"]
    assert torch.equal(after, trained["logprobs"]), "the trained weights were not swapped back"


def test_only_listed_cuda_call_sites_were_redirected(started: dict, trained: dict) -> None:
    from rl_megatron.cpu_compat import CALL_SITES

    listed = {(s.module, s.function) for s in CALL_SITES}
    for rank, observed in enumerate(call_workers(started["policy"], "redirected_call_sites")):
        assert observed, f"rank {rank}: the compatibility layer is not active on a CPU worker"
        unlisted = {tuple(site) for site in observed} - listed
        assert not unlisted, f"rank {rank} redirected call sites missing from CALL_SITES: {sorted(unlisted)}"


def test_workers_never_load_wandb(started: dict, trained: dict) -> None:
    """megatron-core's timers import wandb, whose import-time temp dirs a killed worker leaves behind in the
    session's temp dir (rl_megatron.wandb_guard): after building, training and checkpointing, no worker loaded it."""
    assert call_workers(started["policy"], "wandb_imported") == [False, False]


def test_train_step_matches_dtensor_backend(
    started: dict, trained: dict, pool: Any, tiny_tokenizer: Any, tmp_path: Any
) -> None:
    """Same weights, batch and SGD step: megatron and dtensor agree on the loss and the updated weights."""
    from rlcore.plugins import BackendError, get_registry

    try:
        get_registry().resolve("dtensor", kind="training")
    except BackendError as exc:
        pytest.skip(f"the dtensor backend is not available (plugins/rl-dtensor not installed): {exc}")
    from rlcore.algorithms.loss_functions import NLLLoss
    from rlcore.config import load_config_dict
    from rlcore.policy import Policy

    config = load_config_dict(
        {
            "cluster": {"workers_per_node": 1},
            "policy": {
                "backend": "dtensor",
                "model_name": started["model"],
                "train_global_batch_size": 4,
                "train_micro_batch_size": 1,
                "learning_rate": SGD_LR,
                "max_grad_norm": None,
                "precision": "float32",
                "optimizer": {"name": "torch.optim.SGD", "kwargs": {"lr": SGD_LR}},
            },
        }
    ).policy
    dtensor = Policy(
        pool(1), config, tiny_tokenizer, name_prefix=f"dtensor-vs-{started['name']}", init_reference_model=False
    )
    try:
        result = dtensor.train(started["batch"], NLLLoss())
        dtensor.save_checkpoint(str(tmp_path / "dtensor"))
    finally:
        dtensor.shutdown()
    expected, got = float(result["loss"][0]), float(trained["result"]["loss"][0])
    assert abs(got - expected) <= ATOL * abs(expected), (got, expected)
    initial = state_of(started["model"])
    problems = weight_problems(state_of(trained["weights"]), state_of(str(tmp_path / "dtensor")), initial, ATOL)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("step", ["dpo", "distillation", "full_vocabulary"])
def test_more_losses_match_single_process_sgd(
    started: dict, trained: dict, tmp_path: Any, tiny_tokenizer: Any, step: str
) -> None:
    """Last in the module (they train again, each from the weights the previous test left, saved first): a DPO
    step on pairs of uneven sequences against the initial model's logprobs, and a distillation step reading the
    student's logits at a teacher's top-k ids, and one that adds ``zero_outside_topk`` (the student's
    ``logprobs_at_indices`` and ``entropy``, reduced over the tp-split vocabulary; the oracle's in float64), equal
    the single-process oracle's under tp and pp."""
    if step == "dpo":
        batch, loss_fn = dpo_step(dict(started["batch"]), started["logprobs"], masked_pair=None)
    else:
        batch, loss_fn = distillation_step(
            dict(started["batch"]), tiny_tokenizer, full_vocabulary=step == "full_vocabulary"
        )
    start = tmp_path / "start"
    started["policy"].save_checkpoint(str(start))
    initial, (expected,) = single_process_sgd(str(start), [(batch, loss_fn)], SGD_LR)
    result = started["policy"].train(batch, loss_fn)
    started["policy"].save_checkpoint(str(tmp_path / "weights"))
    loss, grad_norm = float(result["loss"][0]), float(result["grad_norm"][0])
    assert abs(loss - expected.loss) <= ATOL * abs(expected.loss), (loss, expected.loss)
    assert abs(grad_norm - expected.grad_norm) <= ATOL * expected.grad_norm, (grad_norm, expected.grad_norm)
    problems = weight_problems(state_of(str(tmp_path / "weights")), expected.weights, initial, ATOL)
    assert not problems, "\n".join(problems)
