"""Reward-model training (``rm``): the Bradley-Terry loss against a float64 recomputation, reading a sequence's
score, the section's rules, and a real 2-rank dtensor run whose checkpoint scores the validation pairs as the run's
validation did."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlcore.algorithms.rm.batches import rm_batch
from rlcore.algorithms.rm.loss import BradleyTerryLossFn
from rlcore.algorithms.rm.scoring import last_token_scores, scores_from_values
from rlcore.config import ConfigError, load_config, resolve
from rlcore.data import BatchedDataDict

SHIPPED = Path(__file__).parents[2] / "src" / "rlcore" / "examples" / "data" / "preference_dpo.jsonl"


def test_last_token_scores_reads_each_rows_last_real_token_and_values_one_position_later():
    out = torch.randn(3, 5, 1)
    lengths = torch.tensor([2, 5, 1])
    assert last_token_scores(out, lengths).tolist() == [out[0, 1, 0], out[1, 4, 0], out[2, 0, 0]]
    values = torch.zeros(3, 6)
    values[:, 1:] = out[..., 0]  # values[i] is the head at i - 1 (the rows carry one more position)
    assert torch.equal(scores_from_values(values, lengths), last_token_scores(out, lengths))
    with pytest.raises(ValueError, match="input_lengths must be within 1..5"):
        last_token_scores(out, torch.tensor([0, 5, 1]))


def _pairs_batch(rows: int = 8, width: int = 7, seed: int = 0) -> tuple[torch.Tensor, BatchedDataDict]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, width, (rows,), generator=gen)
    values = torch.randn(rows, width, generator=gen, dtype=torch.float64).float()
    sample_mask = torch.ones(rows)
    sample_mask[2:4] = 0  # one masked pair
    data = BatchedDataDict(
        input_ids=torch.zeros(rows, width, dtype=torch.long),
        input_lengths=lengths,
        token_mask=torch.ones(rows, width),
        sample_mask=sample_mask,
    )
    return values, data


def test_bradley_terry_loss_is_the_float64_mean_over_valid_pairs_whatever_the_micro_batch_split():
    values, data = _pairs_batch()
    scores = values.double().gather(1, (data["input_lengths"] - 1)[:, None])[:, 0]
    chosen, rejected = scores[0::2], scores[1::2]
    valid = data["sample_mask"][0::2].bool()
    expected = float(-torch.nn.functional.logsigmoid(chosen - rejected)[valid].mean())
    seqs = data["sample_mask"].sum()
    loss, metrics = BradleyTerryLossFn()(values, data, seqs, torch.tensor(0.0))
    assert float(loss) == pytest.approx(expected, rel=1e-6)
    assert float(metrics["accuracy"]) == pytest.approx(float((chosen > rejected)[valid].double().mean()))
    assert float(metrics["rewards_margin_mean"]) == pytest.approx(float((chosen - rejected)[valid].mean()), rel=1e-6)
    assert float(metrics["num_valid_samples"]) == 3
    total = torch.zeros(())
    for begin in (0, 2, 6):  # micro-batches of 1, 2 and 1 pairs, each normalised by the step's valid pairs
        end = {0: 2, 2: 6, 6: 8}[begin]
        part = BatchedDataDict({k: v[begin:end] for k, v in data.items()})
        total = total + BradleyTerryLossFn()(values[begin:end], part, seqs, torch.tensor(0.0))[0]
    assert float(total) == pytest.approx(expected, rel=1e-6)


def test_bradley_terry_loss_gradient_moves_chosen_up_and_rejected_down():
    values, data = _pairs_batch()
    values.requires_grad_(True)
    BradleyTerryLossFn()(values, data, data["sample_mask"].sum(), torch.tensor(0.0))[0].backward()
    at = data["input_lengths"] - 1
    grads = values.grad.gather(1, at[:, None])[:, 0]
    assert (grads[0::2][[0, 2, 3]] < 0).all() and (grads[1::2][[0, 2, 3]] > 0).all()
    assert grads[2:4].abs().sum() == 0  # the masked pair
    assert float(values.grad.abs().sum()) == pytest.approx(float(grads.abs().sum()))  # the last token only


def rm_config(tmp_path, **overrides):
    base = {
        "policy.model_name": "tiny-llama",
        "policy.dtensor_cfg.enabled": "true",
        "policy.tokenizer.chat_template": "default",
        "policy.train_global_batch_size": "16",
        "policy.train_micro_batch_size": "4",
        "policy.max_total_sequence_length": "64",
        "policy.learning_rate": "0.001",
        "policy.max_grad_norm": "1.0",
        "cluster.workers_per_node": "2",
        "rm.max_num_steps": "20",
        "rm.val_period": "20",
        "rm.val_at_start": "true",
        "rm.val_global_batch_size": "40",
        "rm.val_micro_batch_size": "4",
        "rm.seed": "0",
        "data.train.path": str(SHIPPED),
        "data.input_key": "prompt",
        "data.split_validation_size": "0.1",
        "logger.output_dir": str(tmp_path / "run"),
        "logger.progress_bar": "false",
        "checkpointing.save_every_n_steps": "20",
        **overrides,
    }
    return load_config(None, [f"{k}={v}" for k, v in base.items()])


def test_the_rm_section_refuses_what_it_would_ignore_and_a_backend_without_a_value_head(tmp_path):
    with pytest.raises(ConfigError, match="loss: the config trains rm, so nothing reads the policy-gradient loss"):
        rm_config(tmp_path, **{"loss.ratio_clip_min": "0.1"})
    with pytest.raises(ConfigError, match="policy.backend: 'fsdp1' cannot build a value model"):
        resolve(rm_config(tmp_path, **{"policy.dtensor_cfg.enabled": "false", "policy.backend": "fsdp1"}), run=True)
    assert resolve(rm_config(tmp_path), run=True).policy_head == "value"
    assert rm_config(tmp_path, **{"rm.max_num_steps": "-1"}).rm.max_num_epochs == 1  # -1: the epochs bound it


def test_a_dtensor_rm_run_learns_the_preferences_and_its_checkpoint_scores_them_so(ray_session, tmp_path):
    from transformers import AutoModelForTokenClassification

    from rlcore.run.build import load_run_data
    from rlcore.run.prompts import load_tokenizer
    from rlcore.run.train import train

    resolved = resolve(rm_config(tmp_path), run=True)
    cfg = resolved.config
    train(resolved)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    validated = [r for r in rows if "validation/accuracy" in r]
    start, end = validated[0], validated[-1]
    assert start["step"] <= 0 and end["step"] == 19 and end["validation/num_pairs"] == 40
    assert end["validation/accuracy"] >= 0.7 > start["validation/accuracy"] + 0.1, (start, end)
    assert end["validation/margin"] > start["validation/margin"] and end["validation/loss"] < start["validation/loss"]

    # the step-19 checkpoint is a token-classification model; its last-token scores rank the pairs as validation did
    weights = tmp_path / "run" / "checkpoints" / "step_000019" / "weights"
    model = AutoModelForTokenClassification.from_pretrained(weights, torch_dtype=torch.float64).eval()
    tokenizer = load_tokenizer(cfg)
    batch = rm_batch(load_run_data(cfg, tokenizer).validation, tokenizer, cfg)
    with torch.no_grad():
        logits = model(batch["input_ids"]).logits  # right padding: a causal model's real positions are unchanged
    scores = last_token_scores(logits, batch["input_lengths"] - 1)  # the real tokens, without the score position
    chosen, rejected = scores[0::2], scores[1::2]
    assert float((chosen > rejected).double().mean()) == pytest.approx(end["validation/accuracy"])
    assert float((chosen - rejected).mean()) == pytest.approx(end["validation/margin"], rel=1e-3, abs=1e-4)
    assert float(chosen.mean()) == pytest.approx(end["validation/rewards_chosen_mean"], rel=1e-3, abs=1e-4)
