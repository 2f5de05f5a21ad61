"""DPO runs: preference rows as pairs of sequences, the dpo section's rules, and a real run at dp=2 with dynamic
batching whose loss is checked against a float64 Hugging Face recomputation of DPO on the same pairs."""

from __future__ import annotations

import json

import pytest
import torch

from rlcore.algorithms.dpo.batches import dpo_batch, preference_pair
from rlcore.config import ConfigError, load_config, resolve
from rlcore.datasets import DataError, Sample

USER = [{"role": "user", "content": "q"}]


def test_both_of_nemo_rls_preference_shapes_become_prompt_chosen_rejected():
    binary = Sample(0, USER, {"chosen": "good", "rejected": [{"role": "assistant", "content": "bad"}]})
    assert preference_pair(binary, "x") == (
        USER,
        [{"role": "assistant", "content": "good"}],
        [{"role": "assistant", "content": "bad"}],
    )
    ranked = Sample(
        1,
        USER,
        {
            "completions": [
                {"rank": 1, "completion": [{"role": "assistant", "content": "worse"}]},
                {"rank": 0, "completion": [{"role": "assistant", "content": "best"}]},
            ]
        },
    )
    assert [m[0]["content"] for m in preference_pair(ranked, "x")[1:]] == ["best", "worse"]
    with pytest.raises(DataError, match="x: row 3: a DPO sample needs 'chosen' and 'rejected'"):
        preference_pair(Sample(2, USER, {"chosen": "only"}), "x")


def dpo_config(tmp_path, **overrides):
    words = ("abc", "bcd", "cab", "dab", "abd", "bad", "cad", "dca", "acd", "bca", "dbc", "cdb")
    # uneven pairs: the chosen answer is long, the rejected one short (or the other way round)
    rows = [
        {"prompt": f"reverse {w}", "chosen": w[::-1] * (1 + i % 3), "rejected": w[: 1 + i % 2]}
        for i, w in enumerate(words)
    ]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = {
        "policy.backend": "reference",
        "policy.model_name": "tiny-llama",
        "policy.train_global_batch_size": "4",
        "policy.train_micro_batch_size": "1",
        "policy.max_total_sequence_length": "64",
        "policy.learning_rate": "0.01",
        "policy.tokenizer.chat_template": "default",
        "policy.dynamic_batching.enabled": "true",
        "policy.dynamic_batching.train_mb_tokens": "128",
        "policy.dynamic_batching.logprob_mb_tokens": "96",
        "policy.dynamic_batching.sequence_length_round": "8",
        "cluster.workers_per_node": "2",
        "dpo.max_num_steps": "2",
        "dpo.max_num_epochs": "null",
        "dpo.reference_policy_kl_penalty": "0.5",
        "dpo.sft_loss_weight": "0.3",
        "dpo.preference_average_log_probs": "true",
        "dpo.val_global_batch_size": "4",
        "data.train.path": str(data),
        "data.input_key": "prompt",
        "data.shuffle": "false",
        "logger.output_dir": str(tmp_path / "run"),
        "logger.progress_bar": "false",
        "checkpointing.save_every_n_steps": "1",
        "checkpointing.keep_last": "3",
        **overrides,
    }
    return load_config(None, [f"{k}={v}" for k, v in base.items()])


def test_a_pair_is_two_rows_with_the_response_trained_and_is_cut_as_a_whole(tiny_tokenizer, tmp_path):
    cfg = dpo_config(tmp_path, **{"policy.max_total_sequence_length": "40"})
    fits = Sample(0, USER, {"chosen": "yes", "rejected": "no"})
    too_long = Sample(1, USER, {"chosen": "y" * 50, "rejected": "n"})
    batch = dpo_batch([fits, too_long], tiny_tokenizer, cfg, size=3)
    assert batch.group_size == 2 and batch["input_ids"].shape[0] == 6
    assert batch["sample_mask"].tolist() == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]  # the long pair and the filler pair
    trained = [
        tiny_tokenizer.decode([t for t, m in zip(batch["input_ids"][i].tolist(), batch["token_mask"][i]) if m])
        for i in (0, 1)
    ]
    assert trained == ["yes</s>\n</s>", "no</s>\n</s>"]  # the response (with EOS), never the prompt


@pytest.mark.parametrize(
    "override, expected",
    [
        ({"sft.max_num_steps": "3"}, "dpo, sft: a config trains one algorithm"),
        ({"loss.ratio_clip_min": "0.1"}, "loss: the config trains dpo, so nothing reads the policy-gradient loss"),
    ],
)
def test_a_dpo_config_refuses_what_it_would_ignore(tmp_path, override, expected):
    with pytest.raises(ConfigError, match=expected):
        dpo_config(tmp_path, **override)


def test_a_micro_batch_budget_too_small_for_a_pair_is_refused(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"policy.dynamic_batching.train_mb_tokens: 96 tokens cannot hold a preference "
        r"pair.*set it to at least 128",
    ):
        resolve(dpo_config(tmp_path, **{"policy.dynamic_batching.train_mb_tokens": "96"}), run=True)


def dpo_loss_float64(policy_dir, reference_dir, batch, cfg) -> float:
    """NeMo-RL's DPO loss of ``batch`` (pairs in rows 2i / 2i+1) in float64 from Hugging Face forwards."""
    from transformers import AutoModelForCausalLM

    def token_logprobs(model_dir):
        model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float64)
        with torch.no_grad():
            logits = model(batch["input_ids"]).logits
        return torch.log_softmax(logits[:, :-1], -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]

    mask = batch["token_mask"][:, 1:].double()
    policy, reference = token_logprobs(policy_dir) * mask, token_logprobs(reference_dir) * mask
    tokens = mask.sum(-1)
    ratio = (policy - reference).sum(-1) / tokens  # preference_average_log_probs
    preference = -torch.nn.functional.logsigmoid(cfg.reference_policy_kl_penalty * (ratio[0::2] - ratio[1::2]))
    nll = -policy.sum(-1)[0::2]  # the chosen rows, summed (sft_average_log_probs false)
    return float((cfg.preference_loss_weight * preference + cfg.sft_loss_weight * nll).mean())


def test_a_dpo_run_at_dp2_with_dynamic_batching_trains_the_loss_hugging_face_computes(ray_session, tmp_path):
    from rlcore.run.build import load_run_data
    from rlcore.run.prompts import load_tokenizer
    from rlcore.run.train import train

    resolved = resolve(dpo_config(tmp_path), run=True)
    cfg = resolved.config
    assert resolved.policy.batch.mode == "dynamic" and resolved.policy.data_parallel_size == 2
    tokenizer = load_tokenizer(cfg)
    data = load_run_data(cfg, tokenizer)
    batches = [dpo_batch(data.train.batch(k), tokenizer, cfg) for k in (0, 1)]
    summary = train(resolved)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1] and summary["steps"] == 2
    initial = cfg.policy.model_name
    step0 = tmp_path / "run" / "checkpoints" / "step_000000" / "weights"
    # step 0: policy = reference; step 1 trains the step-0 weights against the initial ones
    assert rows[0]["loss"] == pytest.approx(dpo_loss_float64(initial, initial, batches[0], cfg.dpo), rel=1e-4)
    assert rows[1]["loss"] == pytest.approx(dpo_loss_float64(step0, initial, batches[1], cfg.dpo), rel=1e-4)
    assert 0.0 <= rows[1]["accuracy"] <= 1.0 and rows[0]["accuracy"] == 0.0  # no margin yet at step 0
