"""DPO: the loss against an independent per-pair recomputation, and (chosen, rejected) pairs kept together by
dp sharding, plain micro-batches, dynamic batching and sequence packing, up to a real two-rank Policy step."""

from __future__ import annotations

import math

import pytest
import torch

from rlcore.algorithms.dpo.loss import DPOLossConfig, DPOLossFn
from rlcore.config import ConfigError
from rlcore.config.base import StrictModel
from rlcore.data import BatchedDataDict
from rlcore.interfaces.loss import LossFunction, LossType, step_metrics
from rlcore.training.loop import micro_batches

# -- batches --------------------------------------------------------------------------------------------


def dpo_batch(
    lengths: list[int],
    seed: int = 0,
    vocab: int = 50,
    dtype=torch.float64,
    masked_pairs: tuple[int, ...] = (),
    garbage: bool = True,
) -> BatchedDataDict:
    """Interleaved pairs: row 2i chosen, 2i+1 rejected; ``pair_ids`` / ``is_chosen`` columns to check grouping.

    Each row's prompt is its first 1-2 tokens. With ``garbage`` the padding of the logprob-like columns holds
    -inf / nan, which must reach neither a loss nor a gradient.
    """
    gen = torch.Generator().manual_seed(seed)
    rows, width = len(lengths), max(lengths)
    lens = torch.tensor(lengths)
    pos = torch.arange(width)[None]
    inside = pos < lens[:, None]
    prompt = 1 + (torch.arange(rows) % 2)[:, None]
    ids = torch.where(inside, torch.randint(3, vocab, (rows, width), generator=gen), torch.zeros((), dtype=torch.long))
    ref = -torch.rand(rows, width, generator=gen, dtype=dtype) * 3
    if garbage:
        ref = torch.where(inside, ref, torch.tensor(float("-inf"), dtype=dtype))
    sample_mask = torch.ones(rows)
    for p in masked_pairs:
        sample_mask[2 * p : 2 * p + 2] = 0
    return BatchedDataDict(
        input_ids=ids,
        input_lengths=lens,
        token_mask=(inside & (pos >= prompt)).float(),
        sample_mask=sample_mask,
        reference_policy_logprobs=ref,
        pair_ids=torch.arange(rows) // 2,
        is_chosen=(torch.arange(rows) % 2 == 0).long(),
    )


def random_logprobs(data: BatchedDataDict, seed: int, dtype=torch.float64, garbage: bool = True) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + seed)
    lp = -torch.rand(data["input_ids"].shape, generator=gen, dtype=dtype) * 3
    if garbage:
        inside = torch.arange(lp.shape[1])[None] < data["input_lengths"][:, None]
        lp = torch.where(inside, lp, torch.tensor(float("nan"), dtype=dtype))
    return lp.requires_grad_()


def global_seqs(data) -> torch.Tensor:
    return data["sample_mask"].sum().double()


def global_toks(data) -> torch.Tensor:
    return (data["token_mask"][:, 1:] * data["sample_mask"][:, None]).sum().double()


# -- an independent per-pair recomputation ----------------------------------------------------------------


def reference_dpo(cfg: DPOLossConfig, lp: torch.Tensor, data) -> tuple[torch.Tensor, dict[str, float]]:
    """The DPO loss pair by pair, in float64, straight from the formula (no shared helpers)."""
    n_pairs = int(data["sample_mask"].sum().item()) // 2
    total = lp.new_zeros((), dtype=torch.float64)
    sums = {"pref": 0.0, "sft": 0.0, "acc": 0.0, "chosen": 0.0, "rejected": 0.0}

    def seq(row: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        idx = [t for t in range(1, lp.shape[1]) if data["token_mask"][row, t] != 0]
        mine = torch.stack([lp[row, t].double() for t in idx]) if idx else lp.new_zeros(0, dtype=torch.float64)
        ref = torch.tensor([float(data["reference_policy_logprobs"][row, t]) for t in idx], dtype=torch.float64)
        return mine, ref, len(idx)

    for i in range(0, data.size, 2):
        if data["sample_mask"][i] == 0:
            continue
        (c, c_ref, nc), (r, r_ref, nr) = seq(i), seq(i + 1)
        reward_c, reward_r = (c - c_ref).sum(), (r - r_ref).sum()
        if cfg.preference_average_log_probs:
            reward_c, reward_r = reward_c / max(nc, 1), reward_r / max(nr, 1)
        pref = -torch.log(torch.sigmoid(cfg.reference_policy_kl_penalty * (reward_c - reward_r)))
        sft = -c.sum() / (max(nc, 1) if cfg.sft_average_log_probs else 1)
        total = total + cfg.preference_loss_weight * pref + cfg.sft_loss_weight * sft
        sums["pref"] += pref.item()
        sums["sft"] += sft.item() if cfg.sft_loss_weight > 0 else 0.0
        sums["acc"] += float(reward_c.item() > reward_r.item())
        sums["chosen"] += reward_c.item()
        sums["rejected"] += reward_r.item()
    n = max(n_pairs, 1)
    metrics = {
        "loss": total.item() / n,
        "preference_loss": sums["pref"] / n,
        "sft_loss": sums["sft"] / n,
        "accuracy": sums["acc"] / n,
        "rewards_chosen_mean": sums["chosen"] / n,
        "rewards_rejected_mean": sums["rejected"] / n,
        "rewards_margin_mean": (sums["chosen"] - sums["rejected"]) / n,
        "num_valid_samples": n_pairs,
    }
    return total / n, metrics


CONFIGS = [
    DPOLossConfig(),
    DPOLossConfig(reference_policy_kl_penalty=0.5, preference_average_log_probs=True),
    DPOLossConfig(reference_policy_kl_penalty=2.0, sft_loss_weight=0.3),
    DPOLossConfig(
        reference_policy_kl_penalty=0.1,
        preference_loss_weight=0.7,
        sft_loss_weight=1.0,
        preference_average_log_probs=True,
        sft_average_log_probs=True,
    ),
    DPOLossConfig(preference_loss_weight=0.0, sft_loss_weight=1.0, sft_average_log_probs=True),
]
LENGTHS = [3, 40, 12, 9, 25, 25, 7, 30, 16, 4, 2, 11]


# -- the loss -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize(
    "cfg",
    CONFIGS,
    ids=lambda c: (
        f"b{c.reference_policy_kl_penalty}-s{c.sft_loss_weight}-"
        f"{int(c.preference_average_log_probs)}{int(c.sft_average_log_probs)}"
    ),
)
def test_loss_gradient_and_metrics_match_the_per_pair_formula(cfg, dtype, tol):
    data = dpo_batch(LENGTHS, seed=1, dtype=dtype, masked_pairs=(3,))
    lp = random_logprobs(data, seed=1, dtype=dtype)
    loss, metrics = DPOLossFn(cfg)(lp, data, global_seqs(data), global_toks(data))
    (grad,) = torch.autograd.grad(loss, lp)

    ref_lp = lp.detach().clone().requires_grad_()
    expected, expected_metrics = reference_dpo(cfg, ref_lp, data)
    (expected_grad,) = torch.autograd.grad(expected, ref_lp, allow_unused=True)
    expected_grad = torch.nan_to_num(expected_grad if expected_grad is not None else torch.zeros_like(lp))

    assert loss.dtype == dtype and loss.dim() == 0
    assert abs(loss.item() - expected.item()) <= tol * max(1.0, abs(expected.item()))
    assert torch.isfinite(grad).all()
    torch.testing.assert_close(grad.double(), expected_grad.double(), atol=tol, rtol=tol)
    assert metrics.keys() == expected_metrics.keys()
    for name, value in expected_metrics.items():
        assert metrics[name] == pytest.approx(value, abs=10 * tol, rel=10 * tol), name
    # The masked pair and every padding position get no gradient.
    assert grad[6:8].abs().sum() == 0
    assert (grad * (1 - data["token_mask"])).abs().sum() == 0


def test_known_values():
    """Two pairs by hand: rewards (summed log-ratios) 1 vs -1 and 0 vs 2; beta 0.5."""
    data = BatchedDataDict(
        token_mask=torch.tensor([[0, 1, 1], [0, 1, 0], [0, 1, 1], [0, 1, 1]], dtype=torch.float32),
        sample_mask=torch.ones(4),
        reference_policy_logprobs=torch.zeros(4, 3, dtype=torch.float64),
    )
    lp = torch.tensor([[0, 0.5, 0.5], [0, -1, 0], [0, -1, 1], [0, 1, 1]], dtype=torch.float64)
    loss, m = DPOLossFn({"reference_policy_kl_penalty": 0.5})(lp, data, torch.tensor(4.0), torch.tensor(7.0))
    expected = (-math.log(1 / (1 + math.exp(-1.0))) - math.log(1 / (1 + math.exp(1.0)))) / 2
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    assert m["accuracy"] == 0.5 and m["num_valid_samples"] == 2
    assert m["rewards_chosen_mean"] == pytest.approx(0.5) and m["rewards_rejected_mean"] == pytest.approx(0.5)
    assert m["rewards_margin_mean"] == pytest.approx(0.0) and m["sft_loss"] == 0.0


@pytest.mark.parametrize("cfg", CONFIGS[1:4])
def test_whole_pair_micro_batches_sum_to_the_step(cfg):
    data = dpo_batch(LENGTHS, seed=2, masked_pairs=(1,))
    lp = random_logprobs(data, seed=2)
    fn = DPOLossFn(cfg)
    whole, whole_metrics = fn(lp, data, global_seqs(data), global_toks(data))
    (whole_grad,) = torch.autograd.grad(whole, lp)

    per_mb: dict[str, list[float]] = {}
    total = 0
    for a, b in [(0, 2), (2, 8), (8, 10), (10, 12)]:
        loss, metrics = fn(lp[a:b], data.slice(a, b), global_seqs(data), global_toks(data))
        total = total + loss
        for k, v in metrics.items():
            per_mb.setdefault(k, []).append(float(v))  # 0-dim tensors, read as the training loop reads them
    (split_grad,) = torch.autograd.grad(total, lp)
    assert total.item() == pytest.approx(whole.item(), abs=1e-12)
    torch.testing.assert_close(split_grad, whole_grad, atol=1e-12, rtol=0)
    assert step_metrics(per_mb, 1) == pytest.approx({k: float(v) for k, v in whole_metrics.items()}, abs=1e-12)


def test_protocol_config_and_required_inputs():
    fn = DPOLossFn()
    assert isinstance(fn, LossFunction) and fn.loss_type is LossType.SEQUENCE_LEVEL
    assert fn.cfg == DPOLossConfig(reference_policy_kl_penalty=0.05, preference_loss_weight=1.0, sft_loss_weight=0.0)
    # The same fields as a mapping or as another config model (a run section's copy).
    assert DPOLossFn({"sft_loss_weight": 0.5}).cfg.sft_loss_weight == 0.5
    assert DPOLossFn(DPOLossConfig(reference_policy_kl_penalty=0.2).model_copy()).cfg.reference_policy_kl_penalty == 0.2

    class Settings(StrictModel):
        reference_policy_kl_penalty: float = 0.3
        sft_average_log_probs: bool = True

    assert DPOLossFn(Settings()).cfg == DPOLossConfig(reference_policy_kl_penalty=0.3, sft_average_log_probs=True)
    for bad in ({"reference_policy_kl_penalty": -0.1}, {"sft_loss_weight": -1.0}, {"beta": 0.1}):
        with pytest.raises(ConfigError):
            DPOLossFn(bad)
    data = dpo_batch([5, 6, 7, 8])
    del data["reference_policy_logprobs"]
    with pytest.raises(KeyError, match="reference_policy_logprobs"):
        fn(random_logprobs(data, 0), data, global_seqs(data), global_toks(data))


def test_rows_that_are_not_whole_pairs_are_refused():
    data = dpo_batch([5, 6, 7, 8, 9, 10])
    fn = DPOLossFn()
    lp = random_logprobs(data, 0)
    args = (global_seqs(data), global_toks(data))
    with pytest.raises(ValueError, match="3 rows is not whole"):
        fn(lp[:3], data.slice(0, 3), *args)
    with pytest.raises(ValueError, match="pair_ids"):  # rejected of pair 0 then chosen of pair 1
        fn(lp[1:3], data.slice(1, 3), *args)
    lopsided = data.copy()
    lopsided["sample_mask"] = torch.tensor([1.0, 0, 1, 1, 1, 1])
    with pytest.raises(ValueError, match="different sample_mask"):
        fn(lp, lopsided, *args)
    # Without pair_ids, the sample_indices that sharding records still tell.
    shuffled = data.select_indices([0, 2, 1, 3, 4, 5])
    del shuffled["pair_ids"]
    shuffled.sample_indices = [0, 2, 1, 3, 4, 5]
    with pytest.raises(ValueError, match="rows 0 and 2 of the batch"):
        fn(lp[[0, 2, 1, 3, 4, 5]], shuffled, *args)


def test_import_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, rlcore.algorithms.dpo.loss; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# -- pairs through sharding and micro-batching ----------------------------------------------------------

#: Uneven pairs: (3, 40), (38, 2), ... and dp=2, two optimizer steps.
UNEVEN = [3, 40, 38, 2, 5, 6, 30, 21, 2, 3, 20, 7, 9, 39, 4, 4]
MODES = {
    "plain": {},
    "dynamic": {"dynamic_batching_args": {"max_tokens_per_microbatch": 96, "sequence_length_round": 8}},
    "packing": {"sequence_packing_args": {"max_tokens_per_microbatch": 60, "algorithm": "first_fit_decreasing"}},
}


def worker_micro_batches(data: BatchedDataDict, mode: str, dp: int = 2, gbs: int = 8, mbs: int = 2):
    """What Policy.train hands each rank and what rlcore.training.loop.train_steps makes of it: per rank,
    per step, the micro-batches."""
    sharded = data.shard_by_batch_size(dp, batch_size=gbs, **MODES[mode])
    shards = sharded if mode == "plain" else sharded[0]
    out = []
    for shard in shards:
        steps = shard.size // (gbs // dp) if mode == "plain" else shard.num_steps
        out.append(
            [
                list(micro_batches(shard.get_batch(k, gbs // dp if mode == "plain" else None), mbs, mode))
                for k in range(steps)
            ]
        )
    return out


def whole_pairs(mb: BatchedDataDict) -> bool:
    ids, chosen = mb["pair_ids"].tolist(), mb["is_chosen"].tolist()
    return len(ids) % 2 == 0 and all(
        ids[i] == ids[i + 1] and chosen[i] == 1 and chosen[i + 1] == 0 for i in range(0, len(ids), 2)
    )


@pytest.mark.parametrize("mode", list(MODES))
def test_every_micro_batch_holds_whole_pairs(mode):
    data = dpo_batch(UNEVEN)
    data.group_size = 2
    ranks = worker_micro_batches(data, mode)
    seen = []
    for r, steps in enumerate(ranks):
        for k, mbs in enumerate(steps):
            for mb in mbs:
                assert mb.size and whole_pairs(mb), (mode, r, k, mb["pair_ids"].tolist())
                assert mb.group_size == 2
                # A pair stays in the optimizer step its rows belong to (gbs 8 = 4 pairs).
                assert {p // 4 for p in mb["pair_ids"].tolist()} == {k}
                seen += list(zip(mb["pair_ids"].tolist(), mb["is_chosen"].tolist()))
                if mode == "dynamic":
                    assert mb.size * mb["input_ids"].shape[1] <= 96
                if mode == "packing":
                    assert int(mb["input_lengths"].sum()) <= 60
    assert sorted(seen) == sorted(zip(data["pair_ids"].tolist(), data["is_chosen"].tolist()))
    if mode != "plain":
        # The uneven lengths really did make several micro-batches per step.
        assert max(len(mbs) for steps in ranks for mbs in steps) >= 2


@pytest.mark.parametrize("mode", ["dynamic", "packing"])
def test_without_group_size_the_old_path_splits_pairs_and_the_loss_says_so(mode):
    """The planted bug: the same batch without group_size is cut by length, across pairs."""
    data = dpo_batch(UNEVEN)
    ranks = worker_micro_batches(data, mode)
    mbs = [mb for steps in ranks for step in steps for mb in step]
    assert not all(whole_pairs(mb) for mb in mbs)
    split = next(mb for mb in mbs if mb.size % 2 == 0 and not whole_pairs(mb))
    del split["pair_ids"]  # the loss still knows from the rows' sample_indices
    with pytest.raises(ValueError, match="not one"):
        DPOLossFn()(random_logprobs(split, 0), split, global_seqs(data), global_toks(data))


def test_plain_mode_needs_whole_pairs_per_rank_and_micro_batch():
    data = dpo_batch(UNEVEN[:12])
    # Without grouping 3 rows per rank cut pair 1 in two ranks.
    shards = data.shard_by_batch_size(2, batch_size=6)
    assert shards[0]["pair_ids"][:3].tolist() == [0, 0, 1] and shards[1]["pair_ids"][:3].tolist() == [1, 2, 2]
    data.group_size = 2
    with pytest.raises(ValueError, match="multiple of 2 \\(group_size\\) × 2 \\(shards\\)"):
        data.shard_by_batch_size(2, batch_size=6)
    (shard, _) = data.shard_by_batch_size(2, batch_size=12)
    with pytest.raises(ValueError, match="microbatch_size=3"):
        list(shard.make_microbatch_iterator(3))
    assert [whole_pairs(mb) for mb in shard.make_microbatch_iterator(4)] == [True, True]


def test_groups_survive_selections_of_whole_groups_only():
    data = dpo_batch([4] * 8)
    data.group_size = 2
    assert data.slice(2, 6).group_size == 2 and data.slice(1, 5).group_size == 1
    assert data.select_indices([4, 5, 0, 1]).group_size == 2
    assert data.select_indices([5, 4, 0, 1]).group_size == 1
    assert data.copy().group_size == 2 and data.repeat_interleave(2).group_size == 1
    assert BatchedDataDict.from_batches([data.slice(0, 4), data.slice(4, 8)]).group_size == 2
    with pytest.raises(ValueError, match="group of samples \\[0, 1\\]"):
        dpo_batch([3, 40, 4, 4]).shard_by_batch_size(
            1, dynamic_batching_args={"max_tokens_per_microbatch": 60}, group_size=2
        )
    with pytest.raises(ValueError, match="total length 43"):
        dpo_batch([3, 40, 4, 4]).shard_by_batch_size(
            1, sequence_packing_args={"max_tokens_per_microbatch": 42}, group_size=2
        )


def bigram_logprobs(weights: torch.Tensor, mb: BatchedDataDict) -> torch.Tensor:
    """A differentiable stand-in for a model: log p(token_i | token_{i-1}) from a [V, V] table."""
    ids, lens = mb["input_ids"], mb["input_lengths"]
    lp = torch.log_softmax(weights[ids[:, :-1]], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    out = torch.cat([torch.zeros_like(lp[:, :1]), lp], 1)
    return torch.where(torch.arange(ids.shape[1])[None] < lens[:, None], out, torch.zeros_like(out))


@pytest.mark.parametrize("mode", list(MODES))
def test_dp2_micro_batched_step_equals_the_whole_batch(mode):
    """Loss and gradient of each step summed over both ranks' micro-batches equal the step done at once."""
    data = dpo_batch(UNEVEN, masked_pairs=(2,), garbage=False)
    data.group_size = 2
    weights = torch.randn(50, 50, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    weights.requires_grad_()
    fn = DPOLossFn(DPOLossConfig(reference_policy_kl_penalty=0.5, sft_loss_weight=0.2))
    ranks = worker_micro_batches(data, mode)
    for k in range(2):
        step = data.slice(8 * k, 8 * (k + 1))
        gs, gt = global_seqs(step), global_toks(step)
        whole, _ = fn(bigram_logprobs(weights, step), step, gs, gt)
        (whole_grad,) = torch.autograd.grad(whole, weights)
        total = sum(fn(bigram_logprobs(weights, mb), mb, gs, gt)[0] for steps in ranks for mb in steps[k])
        (grad,) = torch.autograd.grad(total, weights)
        assert total.item() == pytest.approx(whole.item(), abs=1e-12)
        torch.testing.assert_close(grad, whole_grad, atol=1e-12, rtol=0)


# -- a real two-rank Policy step with dynamic batching -----------------------------------------------------


def test_two_rank_policy_dpo_step_with_dynamic_batching(ray_session, tiny_model_dir, tiny_tokenizer):
    """One SGD step of DPO through 2 Ray ranks of the reference backend, dynamic batching on, pairs of very
    uneven lengths, equals one process doing the step on the whole batch."""
    from transformers import AutoModelForCausalLM

    from rlcore.config import load_config_dict
    from rlcore.distributed import RayVirtualCluster
    from rlcore.policy import Policy
    from rlcore.training.logprobs import token_logprobs

    lengths = [3, 40, 38, 2, 6, 5, 22, 24]
    data = dpo_batch(lengths, vocab=len(tiny_tokenizer), garbage=False)  # ids 3.. avoid the special tokens
    del data["is_chosen"]
    data.group_size = 2

    def hf_logprobs(model, batch):
        ids, lens = batch["input_ids"], batch["input_lengths"]
        attention = (torch.arange(ids.shape[1])[None] < lens[:, None]).long()
        return token_logprobs(model(input_ids=ids, attention_mask=attention).logits, ids, lens)

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        initial = hf_logprobs(model, data)
    # A reference that differs from the policy, so rewards and accuracy are not trivial.
    shift = 0.3 * torch.randn(initial.shape, generator=torch.Generator().manual_seed(5))
    data["reference_policy_logprobs"] = initial + shift
    cfg = DPOLossConfig(reference_policy_kl_penalty=0.5, sft_loss_weight=0.1)

    expected, expected_metrics = reference_dpo(cfg, hf_logprobs(model, data), data)
    expected.backward()
    expected_norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in model.parameters())).item()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.5 * p.grad
        expected_after = hf_logprobs(model, data)

    raw = {
        "cluster": {"workers_per_node": 2},
        "policy": {
            "backend": "reference",
            "model_name": tiny_model_dir,
            "train_global_batch_size": 8,
            "train_micro_batch_size": 2,
            "logprob_batch_size": 2,
            "max_grad_norm": None,
            "dynamic_batching": {
                "enabled": True,
                "train_mb_tokens": 96,
                "logprob_mb_tokens": 96,
                "sequence_length_round": 8,
            },
            "optimizer": {"name": "torch.optim.SGD", "kwargs": {"lr": 0.5}},
        },
    }
    cluster = RayVirtualCluster([2])
    policy = Policy(cluster, load_config_dict(raw).policy, tiny_tokenizer)
    try:
        ref = policy.get_reference_policy_logprobs(data)["reference_logprobs"]
        torch.testing.assert_close(ref, initial, atol=1e-5, rtol=0)
        result = policy.train(data, DPOLossFn(cfg))
        # Several micro-batches per rank: the pairs really were planned by length.
        assert len(result["all_mb_metrics"]["loss"]) > 2
        assert result["loss"].shape == (1,)
        assert result["loss"][0].item() == pytest.approx(expected.item(), abs=1e-5)
        assert result["grad_norm"][0].item() == pytest.approx(expected_norm, rel=1e-4)
        for name in ("accuracy", "rewards_chosen_mean", "rewards_rejected_mean", "sft_loss", "preference_loss"):
            assert result["metrics"][name] == pytest.approx(expected_metrics[name], abs=1e-4), name
        torch.testing.assert_close(policy.get_logprobs(data)["logprobs"], expected_after, atol=1e-5, rtol=0)
    finally:
        policy.shutdown()
        cluster.shutdown()
