"""The seeds' config contract as a plain dict (``PolicyConfig`` is a ``TypedDict`` there), and the
fields that used to be accepted and then ignored."""

from __future__ import annotations

import pytest
import torch

from rlcore.algorithms.loss_functions import ClippedPGLossFn, NLLLoss
from rlcore.config import ConfigError, PolicyConfig, as_policy_config, load_config_dict, resolve_policy
from rlcore.data import BatchedDataDict
from rlcore.testing.models import make_batch
from rlcore.training.loop import pad_to_multiple


def test_a_dict_becomes_the_model_with_dotted_one_line_errors():
    cfg = as_policy_config({"train_global_batch_size": 4, "dtensor_cfg": {"tensor_parallel_size": 1}})
    assert isinstance(cfg, PolicyConfig) and cfg.train_global_batch_size == 4
    assert as_policy_config(cfg) is cfg
    with pytest.raises(ConfigError) as info:
        as_policy_config({"train_global_batchsize": 4, "precision": "fp8"})
    assert info.value.problems == [
        "policy.precision: expected one of 'float32', 'bfloat16' or 'float16', got 'fp8'",
        "policy.train_global_batchsize: unknown key; did you mean 'train_global_batch_size'?",
    ]
    # Resolved for the cluster's size, the cross-field rules and the layout run too, as for a config file.
    with pytest.raises(ConfigError, match=r"^policy.train_global_batch_size: 3 is not divisible by data-parallel"):
        resolve_policy({"train_global_batch_size": 3}, world_size=2, use_gpu=False)
    with pytest.raises(TypeError):
        as_policy_config(["not", "a", "dict"])


def test_a_nemo_rl_policy_dict_given_to_policy_says_how_to_convert_it():
    """NeMo-RL code passes NeMo-RL's own policy section; Policy refuses it before any worker starts."""
    from rlcore.policy.lm_policy import resolved_policy

    class Cluster:  # only what resolution reads of a RayVirtualCluster
        world_size, use_gpus = 2, False

    with pytest.raises(ConfigError) as info:
        resolved_policy({"dtensor_cfg": {"_v2": True, "enabled": True}, "logprob_chunk_size": None}, Cluster())
    assert info.value.problems[-1].startswith(
        "hint: this is a NeMo-RL policy config; convert it with rlcore.nemo_rl.policy_config_from_nemo_rl(config)"
    )


def test_loss_functions_take_the_dict_with_the_same_errors():
    assert ClippedPGLossFn({"ratio_clip_min": 0.1}).cfg.ratio_clip_min == 0.1
    with pytest.raises(ConfigError) as info:
        ClippedPGLossFn({"ratio_clip_mn": 0.1, "reference_policy_kl_type": "k4"})
    assert info.value.problems == [
        "loss.reference_policy_kl_type: expected one of 'k1', 'k2' or 'k3', got 'k4'",
        "loss.ratio_clip_mn: unknown key; did you mean 'ratio_clip_min'?",
    ]
    assert NLLLoss().loss_type is not None  # no config at all


def test_silently_ignored_fields_are_now_checked_at_load():
    def problems(policy: dict) -> list[str]:
        with pytest.raises(ConfigError) as info:
            load_config_dict({"policy": policy})
        return info.value.problems

    assert problems({"optimizer": {"kwargs": {"weigth_decay": 0.1}}}) == [
        "policy.optimizer.kwargs.weigth_decay: not an argument of torch.optim.AdamW; did you mean 'weight_decay'?"
    ]
    assert problems({"scheduler": [{"name": "torch.optim.lr_scheduler.LinearLR", "kwargs": {"total_iter": 3}}]}) == [
        "policy.scheduler[0].kwargs.total_iter: not an argument of torch.optim.lr_scheduler.LinearLR; did you "
        "mean 'total_iters'?"
    ]
    assert problems({"optimizer": {"name": "SGD", "kwargs": {"params": [], "lr": 0.1}}}) == [
        "policy.optimizer.kwargs.params: is passed by rlcore (the model's parameters); remove it"
    ]
    (line,) = problems({"sequence_packing": {"algorithm": "best_fit"}})
    assert line.startswith("policy.sequence_packing.algorithm: expected one of 'concatenative'")
    (line,) = problems({"fsdp_offload_enabled": True})
    assert line.startswith("policy.fsdp_offload_enabled: is true but the training backend is 'dtensor'")
    megatron = load_config_dict(
        {
            "policy": {
                "dtensor_cfg": {"enabled": False},
                "megatron_cfg": {
                    "enabled": True,
                    "distributed_data_parallel_config": {"data_parallel_sharding_strategy": "optim"},
                },
            }
        }
    )
    with pytest.raises(ConfigError) as info:  # the megatron backend's own config check, at resolution
        resolve_policy(megatron.policy, world_size=2, use_gpu=False)
    (line,) = info.value.problems
    assert "only applies to Megatron's custom FSDP" in line
    # The check reads the class from source: torch is not imported by loading a config.
    import subprocess
    import sys

    code = (
        "import sys; from rlcore.config import load_config_dict; "
        "load_config_dict({'policy': {'optimizer': {'kwargs': {'weight_decay': 0.1}}}}); "
        "print(sorted(m for m in ('torch', 'ray', 'numpy', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stderr


def test_padding_to_a_multiple_touches_only_padding():
    mb = BatchedDataDict(make_batch(300, 3, 4, 9, seed=1))
    mb["token_mask"] = torch.ones_like(mb["input_ids"], dtype=torch.float32)
    width = mb["input_ids"].shape[1]
    padded = pad_to_multiple(mb.copy(), 8)
    assert padded["input_ids"].shape[1] % 8 == 0 and padded["token_mask"].shape[1] == padded["input_ids"].shape[1]
    assert torch.equal(padded["input_ids"][:, :width], mb["input_ids"])
    assert padded["token_mask"][:, width:].sum() == 0 and torch.equal(padded["input_lengths"], mb["input_lengths"])
    assert pad_to_multiple(mb, 1) is mb


@pytest.mark.parametrize("estimator, nemo", [("leave_one_out_std", (True, True)), ("mean", (False, False))])
def test_new_advantage_estimators_match_nemo_rl(estimator, nemo):
    """NeMo-RL's GRPO advantage (calculate_baseline_and_std_per_prompt, then / (std + 1e-6) where std > 0)."""
    from rlcore.algorithms.grpo.advantages import group_advantages

    rewards = torch.tensor([1.0, 0.0, 0.5, 0.2, 1.0, 1.0, 1.0, 1.0])
    got = group_advantages(rewards, 4, estimator).double()
    loo, normalize = nemo
    expected = []
    for g in rewards.double().view(2, 4):
        for i in range(4):
            others = torch.cat([g[:i], g[i + 1 :]]) if loo else g
            base = others.mean()
            std = others.std() if len(others) > 1 else torch.tensor(0.0)
            adv = g[i] - base
            expected.append(adv / (std + 1e-6) if normalize and std > 0 else adv)
    torch.testing.assert_close(got, torch.stack(expected), atol=1e-5, rtol=0)


def test_policy_takes_the_seed_dict_and_pads_to_the_multiple(make_cluster, tiny_model_dir, tiny_tokenizer):
    """Policy(cluster, plain dict, tokenizer) trains and gives the logprobs of Policy(cluster, model, ...).

    The dict also asks for make_sequence_length_divisible_by=7: every micro-batch is padded to a multiple
    of 7, which must change nothing for the real tokens (same logprobs, same step).
    """
    from rlcore.plugins import get_registry
    from rlcore.policy import Policy

    backend = (
        "dtensor" if any(r.name == "dtensor" and r.status == "ok" for r in get_registry().records) else "reference"
    )
    raw = {
        "backend": backend,
        "model_name": tiny_model_dir,
        "train_global_batch_size": 4,
        "train_micro_batch_size": 2,
        "logprob_batch_size": 2,
        "max_grad_norm": None,
        "precision": "float32",
        "max_total_sequence_length": 20,
        "optimizer": {"name": "torch.optim.SGD", "kwargs": {"lr": 0.5}},
    }
    batch = BatchedDataDict(make_batch(tiny_tokenizer, 4, 5, 13, seed=7))
    batch["token_mask"] = (torch.arange(batch["input_ids"].shape[1])[None] < batch["input_lengths"][:, None]).float()
    batch["sample_mask"] = torch.ones(4)
    results = []
    for config in (
        {**raw, "make_sequence_length_divisible_by": 7},
        load_config_dict({"cluster": {"workers_per_node": 2}, "policy": raw}).policy,
    ):
        cluster = make_cluster(2)
        policy = Policy(cluster, config, tiny_tokenizer, name_prefix="plain-dict")
        try:
            assert isinstance(policy.cfg, PolicyConfig)
            before = policy.get_logprobs(batch)["logprobs"]
            out = policy.train(batch, NLLLoss())
            after = policy.get_logprobs(batch)["logprobs"]
            if not results:
                too_long = BatchedDataDict(make_batch(tiny_tokenizer, 2, 21, 24, seed=1))
                with pytest.raises(ValueError, match="longer than policy.max_total_sequence_length=20"):
                    policy.get_logprobs(too_long)
                if "refit" in policy.spec.capabilities:  # the seed-001 refit names, as adapters
                    info = policy.prepare_info_for_collective()
                    assert info == policy.prepare_refit_info() and info
                    groups = policy.prepare_weights_for_ipc(_refit_buffer_size_gb=1e-4)  # ~100 KiB per group
                    assert [n for g in groups for n in g] == list(info) and len(groups) > 1
                    with pytest.raises(NotImplementedError, match="stream_weights_via_ipc_zmq"):
                        policy.get_weights_ipc_handles(groups[0])
        finally:
            policy.shutdown()
        results.append((before, float(out["loss"][0]), after))
    (b0, l0, a0), (b1, l1, a1) = results
    torch.testing.assert_close(b0, b1, atol=1e-5, rtol=0)
    assert abs(l0 - l1) < 1e-5
    torch.testing.assert_close(a0, a1, atol=1e-5, rtol=0)
    assert not torch.allclose(a0, b0)  # the step did move the weights
