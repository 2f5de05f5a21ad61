"""SFT: message logs tokenized with the loss on the assistant's tokens, the sft section's rules, and a real run
whose losses are checked against a float64 Hugging Face forward of the same samples."""

from __future__ import annotations

import json

import pytest
import torch

from rlcore.algorithms.sft.batches import encode_conversation, sft_batch
from rlcore.config import ConfigError, SFTConfig, load_config, resolve
from rlcore.datasets import DataError, Sample

CHAT = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "yo"},
    {"role": "user", "content": "q"},
    {"role": "assistant", "content": "ok"},
]


def trained_text(tokenizer, ids, mask):
    return tokenizer.decode([i for i, m in zip(ids, mask) if m])


def test_the_loss_mask_covers_the_assistant_messages_and_the_final_eos(tiny_tokenizer):
    ids, mask = encode_conversation(tiny_tokenizer, CHAT, SFTConfig(add_generation_prompt=True))
    # the tokens are the whole log's rendering (byte-level: per-message chunks join exactly), then the EOS
    whole = tiny_tokenizer.encode(tiny_tokenizer.apply_chat_template(CHAT, tokenize=False), add_special_tokens=False)
    assert ids == [*whole, tiny_tokenizer.eos_token_id] and len(mask) == len(ids)
    assert trained_text(tiny_tokenizer, ids, mask) == "yo</s>\nok</s>\n</s>"
    # without the generation prompt the assistant header is part of the assistant's tokens (NeMo-RL's default)
    ids, mask = encode_conversation(tiny_tokenizer, CHAT, SFTConfig())
    assert trained_text(tiny_tokenizer, ids, mask) == "<|assistant|>\nyo</s>\n<|assistant|>\nok</s>\n</s>"
    # only the final answer
    ids, mask = encode_conversation(tiny_tokenizer, CHAT, SFTConfig(add_generation_prompt=True, only_unmask_final=True))
    assert trained_text(tiny_tokenizer, ids, mask) == "ok</s>\n</s>"
    # no EOS added (the template's own stay), and a log ending with the user trains nothing at the end
    ids, mask = encode_conversation(tiny_tokenizer, CHAT[:4], SFTConfig(add_eos=False, add_generation_prompt=True))
    assert ids[-1] != tiny_tokenizer.eos_token_id or tiny_tokenizer.decode(ids).endswith("q</s>\n")
    assert mask[-1] == 0


def test_a_template_that_rewrites_earlier_messages_is_refused(tiny_tokenizer):
    import copy

    tokenizer = copy.deepcopy(tiny_tokenizer)  # the session fixture keeps its template
    tokenizer.chat_template = "{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(DataError, match="does not extend the rendering of the messages before message 2"):
        encode_conversation(tokenizer, CHAT, SFTConfig())


def sft_config(tmp_path, **overrides):
    rows = [
        {"messages": [{"role": "user", "content": f"reverse {w}"}, {"role": "assistant", "content": w[::-1]}]}
        for w in ("abc", "bcd", "cab", "dab", "abd", "bad", "cad", "dca")
    ]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = {
        "policy.backend": "reference",
        "policy.model_name": "tiny-llama",
        "policy.train_global_batch_size": "4",
        "policy.train_micro_batch_size": "1",
        "policy.max_total_sequence_length": "64",
        "policy.learning_rate": "0.01",
        "policy.tokenizer.chat_template": "default",
        "cluster.workers_per_node": "2",
        "sft.max_num_steps": "4",
        "sft.max_num_epochs": "null",
        "sft.val_at_start": "true",
        "sft.val_period": "2",
        "sft.val_global_batch_size": "4",
        "sft.val_micro_batch_size": "2",
        "data.train.path": str(data),
        "data.validation.path": str(data),
        "logger.output_dir": str(tmp_path / "run"),
        "logger.progress_bar": "false",
        "checkpointing.save_every_n_steps": "2",
        **overrides,
    }
    return load_config(None, [f"{k}={v}" for k, v in base.items()])


def test_a_long_sample_is_cut_and_masked_and_filler_rows_train_nothing(tiny_tokenizer, tmp_path):
    cfg = sft_config(tmp_path, **{"policy.max_total_sequence_length": "32"})
    long = Sample(0, [{"role": "user", "content": "x" * 40}, {"role": "assistant", "content": "y"}], {})
    short = Sample(1, [{"role": "user", "content": "a"}], {"ground_truth": 7})  # a prompt/answer row
    batch = sft_batch([long, short], tiny_tokenizer, cfg, size=4)
    assert batch["input_ids"].shape == (4, 32) and batch["sample_mask"].tolist() == [0.0, 1.0, 0.0, 0.0]
    assert int(batch["input_lengths"][0]) == 32
    answer = trained_text(tiny_tokenizer, batch["input_ids"][1].tolist(), batch["token_mask"][1].tolist())
    assert answer == "<|assistant|>\n7</s>\n</s>"  # the row's output_key answer, as the assistant's reply
    with pytest.raises(DataError, match="row 3 has no assistant message"):
        sft_batch([Sample(2, [{"role": "user", "content": "a"}], {})], tiny_tokenizer, cfg)


@pytest.mark.parametrize(
    "override, expected",
    [
        ({"grpo.max_num_steps": "3"}, "grpo, sft: a config trains one algorithm"),
        ({"loss.ratio_clip_min": "0.1"}, "loss: the config trains sft, so nothing reads the policy-gradient loss"),
        ({"env.name": "math"}, "env: the config trains sft, so nothing reads the environment"),
        ({"policy.generation.backend": "vllm"}, "policy.generation: sft does not generate"),
        ({"data.validation": "null", "sft.val_period": "2"}, "sft.val_period, sft.val_at_start: there is nothing"),
    ],
)
def test_sections_an_sft_run_would_ignore_are_refused(tmp_path, override, expected):
    with pytest.raises(ConfigError, match=expected):
        sft_config(tmp_path, **override)


def test_validation_batches_must_split_over_the_ranks(tmp_path):
    with pytest.raises(
        ConfigError,
        match="sft.val_global_batch_size: 4 is not divisible by data-parallel size 2 × sft.val_micro_batch_size 4",
    ):
        resolve(sft_config(tmp_path, **{"sft.val_micro_batch_size": "4"}), run=True)


def nll_per_token_float64(model_dir, batch) -> float:
    """The NLL per trained token of ``batch`` in float64, from Hugging Face's forward (independent of rlcore)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float64)
    with torch.no_grad():
        logits = model(batch["input_ids"]).logits
    logprobs = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    mask = batch["token_mask"][:, 1:].double() * batch["sample_mask"][:, None].double()
    positions = torch.arange(batch["input_ids"].shape[1] - 1)[None]
    mask = mask * (positions + 1 < batch["input_lengths"][:, None])
    return float(-(logprobs * mask).sum() / mask.sum())


def test_an_sft_run_trains_the_loss_hugging_face_computes(ray_session, tmp_path, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    from rlcore.run.build import load_run_data
    from rlcore.run.prompts import load_tokenizer
    from rlcore.run.train import train

    resolved = resolve(sft_config(tmp_path), run=True)
    cfg = resolved.config
    tokenizer = load_tokenizer(cfg)
    data = load_run_data(cfg, tokenizer)
    first = sft_batch(data.train.batch(0), tokenizer, cfg)
    validation = sft_batch(data.validation, tokenizer, cfg)
    summary = train(resolved)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [-1, 0, 1, 2, 3] and summary["steps"] == 4
    model = cfg.policy.model_name
    # the initial weights: step -1's validation loss and step 0's training loss, against float64 HF
    assert rows[0]["validation/loss"] == pytest.approx(nll_per_token_float64(model, validation), rel=1e-4)
    assert rows[1]["loss"] == pytest.approx(nll_per_token_float64(model, first), rel=1e-4)
    assert rows[1]["num_valid_tokens"] == float((first["token_mask"][:, 1:] * first["sample_mask"][:, None]).sum())
    # training lowers the loss on these (seen) samples, and the final weights are an HF model with that loss
    assert rows[4]["validation/loss"] < rows[2]["validation/loss"] < rows[0]["validation/loss"]
    final = summary["final_weights"]
    AutoModelForCausalLM.from_pretrained(final)
    assert nll_per_token_float64(final, validation) == pytest.approx(rows[4]["validation/loss"], rel=1e-4)
    assert summary["first_validation_loss"] == rows[0]["validation/loss"]
    assert (tmp_path / "run" / "loss_curve.png").stat().st_size > 1000
    # finished: the summary is on disk, where a policy.warm_start naming this run finds its last checkpoint
    assert json.loads((tmp_path / "run" / "summary.json").read_text()) == json.loads(json.dumps(summary))


@pytest.mark.parametrize("name", ["sft_tiny", "dpo_tiny"])
def test_a_shown_offline_config_validates_again(name, tmp_path):
    """``rlcore config show`` writes every section, GRPO's at their defaults; those say nothing and pass."""
    import subprocess
    import sys

    shown = subprocess.run(
        [sys.executable, "-m", "rlcore", "config", "show", name], capture_output=True, text=True, check=True
    ).stdout
    (tmp_path / "shown.yaml").write_text(shown)
    again = load_config(tmp_path / "shown.yaml")
    assert again.algorithm == name.split("_")[0] and again.grpo is None
