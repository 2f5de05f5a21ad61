"""``data.max_input_seq_length`` (NeMo-RL's): a prompt (GRPO), SFT sample or DPO pair that long is cut as NeMo-RL's
processors cut it and masked out of the loss; a shorter one is untouched; a limit above
``policy.max_total_sequence_length`` is refused before anything starts.

The GRPO part rolls out through the real rollout loop (:func:`rlcore.run.rollouts.run_rollout`) with a stand-in
engine whose completions depend only on each request's sampling seed, so a run with the limit and one without it
generate the same completions for the prompts the limit leaves alone. The loss with the cut samples masked is
compared with the float64 token-by-token reference of ``tests/algorithms/test_losses.py`` on the batch without
those rows.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rlcore.datasets import DataError, Sample
from rlcore.run.rollouts import run_rollout
from rlcore.run.step import Timer, prompt_ids, training_batch
from tests.algorithms.test_losses import reference_pg
from tests.run.test_multi_turn import ByteTokenizer

LIMIT = 12  # data.max_input_seq_length of the GRPO tests; ByteTokenizer: a prompt of n bytes is n + 1 tokens (BOS)
GROUP = 3  # completions per prompt


class SeededEngine:
    """Three tokens per request drawn from its ``sampling_seeds`` (an engine honouring the seeds), logprobs too."""

    def __call__(self, batch):
        ids, lengths = batch["input_ids"], batch["input_lengths"]
        rows, width = ids.shape[0], ids.shape[1] + 3
        out, logprobs = torch.zeros(rows, width, dtype=torch.long), torch.zeros(rows, width)
        for r in range(rows):
            gen = torch.Generator().manual_seed(int(batch["sampling_seeds"][r]) % 2**31)
            n = int(lengths[r])
            out[r, :n] = ids[r, :n]
            out[r, n : n + 3] = torch.randint(3 + ord("a"), 3 + ord("e"), (3,), generator=gen)
            logprobs[r, n : n + 3] = -torch.rand(3, generator=gen) - 0.1
        return {
            "output_ids": out,
            "logprobs": logprobs,
            "generation_logprobs": logprobs,
            "generation_lengths": torch.full((rows,), 3),
            "unpadded_sequence_lengths": lengths + 3,
            "truncated": torch.zeros(rows, dtype=torch.bool),
        }


class CountingA:
    """Reward: the number of 'a's in the completion (so the copies of a prompt differ)."""

    def step(self, logs, metadata):
        from rlcore.interfaces.environment import EnvironmentReturn

        rewards = [float(log[-1]["content"].count("a")) for log in logs]
        return EnvironmentReturn([{}] * len(logs), [None] * len(logs), rewards, [True] * len(logs))


def rollout_cfg(max_input: int | None):
    return SimpleNamespace(
        algorithm_section=SimpleNamespace(max_rollout_turns=1, seed=3),
        policy=SimpleNamespace(max_total_sequence_length=64, tokenizer=SimpleNamespace(chat_template_kwargs={})),
        data=SimpleNamespace(max_input_seq_length=max_input),
    )


# prompt tokens (BOS + bytes): 3, LIMIT - 1 (kept), LIMIT (cut: NeMo-RL's `length >= max_seq_length`), 31 (cut)
PROMPTS = ["hi", "b" * (LIMIT - 2), "c" * (LIMIT - 1), "d" * 30]
CUT = [False, False, True, True]


def roll_out(max_input: int | None):
    samples = [Sample(i, [{"role": "user", "content": text}], {}) for i, text in enumerate(PROMPTS)]
    return run_rollout(rollout_cfg(max_input), SeededEngine(), CountingA(), ByteTokenizer(), samples, GROUP, Timer())


def test_a_prompt_at_the_limit_is_cut_to_nemo_rl_s_four_tokens_and_masked_the_others_are_untouched():
    tokenizer = ByteTokenizer()
    full = [prompt_ids(tokenizer, text) for text in PROMPTS]
    assert [len(ids) >= LIMIT for ids in full] == CUT
    cut, plain = roll_out(LIMIT), roll_out(None)
    rows = [p for p, c in enumerate(CUT) for _ in range(GROUP) if c]
    kept = [p for p, c in enumerate(CUT) for _ in range(GROUP) if not c]
    data = cut.data
    assert data["prompt_cut"].tolist() == [CUT[i // GROUP] for i in range(len(PROMPTS) * GROUP)]
    for row in range(len(PROMPTS) * GROUP):
        prompt = full[row // GROUP]
        length = int(data["input_lengths"][row])
        if CUT[row // GROUP]:  # NeMo-RL's math_hf_data_processor: its one message keeps min(4, limit // 1)
            assert length == 4 and data["output_ids"][row, :4].tolist() == prompt[:4]
        else:
            assert length == len(prompt) and data["output_ids"][row, :length].tolist() == prompt
    assert cut.metrics["cut_prompts"] == 2.0 and "cut_prompts" not in plain.metrics
    # the prompts under the limit: the very rollout a run without the limit makes (tokens, logprobs, rewards)
    for key in ("output_ids", "logprobs", "token_mask", "unpadded_sequence_lengths"):
        a, b = data[key][kept], plain.data[key][kept]
        width = int(data["unpadded_sequence_lengths"][kept].max())
        assert torch.equal(a[:, :width] if a.dim() == 2 else a, b[:, :width] if b.dim() == 2 else b), key
    assert torch.equal(cut.rewards[kept], plain.rewards[kept])
    # the cut prompts were still generated from and scored
    assert (data["generation_lengths"][rows] == 3).all()
    assert not plain.data["prompt_cut"].any()
    assert training_batch(data, torch.zeros(len(data["input_lengths"])))["sample_mask"].tolist() == [
        0.0 if CUT[i // GROUP] else 1.0 for i in range(len(PROMPTS) * GROUP)
    ]


@pytest.mark.parametrize("token_level", [True, False], ids=["tok", "seq"])
def test_the_cut_samples_add_nothing_to_the_loss_or_its_gradient(token_level):
    from rlcore.algorithms.grpo.advantages import group_advantages
    from rlcore.algorithms.grpo.loss import ClippedPGLossFn

    rollout = roll_out(LIMIT)
    advantages = group_advantages(rollout.rewards, GROUP, "leave_one_out_std")
    assert advantages.abs().sum() > 0
    data = training_batch(rollout.data, advantages)
    data["prev_logprobs"] = data["generation_logprobs"].double()
    mask = data["token_mask"]
    gen = torch.Generator().manual_seed(0)
    logprobs = data["prev_logprobs"] + (torch.rand(mask.shape, generator=gen, dtype=torch.float64) - 0.5) * mask
    logprobs.requires_grad_(True)
    cfg = {"token_level_loss": token_level}

    def counts(batch):
        valid = batch["token_mask"][:, 1:] * batch["sample_mask"][:, None]
        return batch["sample_mask"].sum(), valid.sum()

    loss, _ = ClippedPGLossFn(cfg)(logprobs, data, *counts(data))
    loss.backward()
    kept = [i for i, cut in enumerate(data["sample_mask"].tolist()) if cut]
    dropped = data.select_indices(kept)
    dropped["sample_mask"] = torch.ones(len(kept))  # the batch a run without those prompts trains on
    ref_loss, ref_grad, _ = reference_pg(
        cfg, logprobs.detach()[kept], {k: v for k, v in dropped.items()}, *(float(c) for c in counts(dropped))
    )
    np.testing.assert_allclose(loss.item(), ref_loss, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(logprobs.grad[kept].numpy(), ref_grad, rtol=1e-6, atol=1e-9)
    cut_rows = [i for i in range(len(data["sample_mask"])) if i not in kept]
    assert (logprobs.grad[cut_rows] == 0).all()
    # negative control: the same batch with the cut samples trained moves the loss
    unmasked = dict(data.items(), sample_mask=torch.ones(len(data["sample_mask"])))
    other, _ = ClippedPGLossFn(cfg)(logprobs.detach(), unmasked, *counts(unmasked))
    assert abs(other.item() - ref_loss) > 1e-3


def test_dynamic_sampling_never_keeps_a_cut_group_whatever_its_rewards():
    from rlcore.algorithms.grpo.dynamic_sampling import DynamicSamplingError, sample_with_signal
    from tests.algorithms.test_dynamic_sampling import _cfg

    cfg = _cfg(num_prompts_per_step=1, num_generations_per_prompt=GROUP, dynamic_sampling_max_gen_batches=2)
    rollout = roll_out(LIMIT)
    assert rollout.rewards.view(-1, GROUP).std(dim=1).gt(0).tolist()[2:] == [True, True]  # the cut groups differ
    from rlcore.run.rollouts import Rollout

    def only(groups):
        rows = [r for g in groups for r in range(g * GROUP, (g + 1) * GROUP)]
        return Rollout(rollout.data.select_indices(rows), rollout.rewards[rows], dict(rollout.metrics))

    assert rollout.rewards[:GROUP].std() > 0  # and so do the first prompt's
    batches = iter([only([2, 3]), only([3, 0])])
    trained, _ = sample_with_signal(cfg, lambda: [0], lambda _: next(batches), 0)
    assert torch.equal(trained.rewards, rollout.rewards[:GROUP]) and not trained.data["prompt_cut"].any()
    assert trained.metrics["cut_prompts"] == 4.0  # summed over the step's generation batches
    batches = iter([only([2, 3]), only([3, 2])])
    with pytest.raises(DynamicSamplingError, match="4 had their prompt cut at data.max_input_seq_length"):
        sample_with_signal(cfg, lambda: [0], lambda _: next(batches), 0)


# -- SFT and DPO: NeMo-RL's sft_processor (length >= limit) and preference_preprocessor (length > limit) ------------

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue, or perhaps green."},
]
SHORT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]


def offline_cfg(tmp_path: Path, algorithm: str, max_input: int | None, max_total: int = 256):
    from rlcore.config import load_config

    data = tmp_path / "rows.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}\n')
    overrides = {
        "policy.backend": "reference",
        "policy.model_name": "tiny-llama",
        "policy.max_total_sequence_length": str(max_total),
        "policy.tokenizer.chat_template": "default",
        "data.train.path": str(data),
        "data.max_input_seq_length": "null" if max_input is None else str(max_input),
        f"{algorithm}.max_num_steps": "1",
    }
    return load_config(None, [f"{k}={v}" for k, v in overrides.items()])


def test_an_sft_sample_of_the_limit_is_cut_per_message_and_its_loss_is_the_loss_without_it(tiny_tokenizer, tmp_path):
    from rlcore.algorithms.sft.batches import encode_conversation, encode_messages, sft_batch
    from rlcore.algorithms.sft.loss import NLLLoss

    base = offline_cfg(tmp_path, "sft", None)
    long_ids, _ = encode_conversation(tiny_tokenizer, CHAT, base.sft)
    short_ids, short_mask = encode_conversation(tiny_tokenizer, SHORT, base.sft)
    assert len(short_ids) < len(long_ids)
    samples = [Sample(0, CHAT, {}), Sample(1, SHORT, {})]
    cfg = offline_cfg(tmp_path, "sft", len(long_ids))  # NeMo-RL: `length >= max_seq_length` is masked
    batch = sft_batch(samples, tiny_tokenizer, cfg)
    assert batch["sample_mask"].tolist() == [0.0, 1.0]
    keep = min(4, len(long_ids) // len(CHAT))  # NeMo-RL's cut: each message's first min(4, limit // messages)
    chunks = encode_messages(tiny_tokenizer, CHAT, cfg.sft)
    expected = [t for ids, _ in chunks for t in ids[:keep]]
    assert batch["input_ids"][0, : int(batch["input_lengths"][0])].tolist() == expected
    assert batch["input_ids"][1, : len(short_ids)].tolist() == short_ids  # the short one is as it was
    assert batch["token_mask"][1, : len(short_ids)].tolist() == short_mask
    # one token more and the long one trains too: the rule is `>=`, and without the field `> max_total`
    above = offline_cfg(tmp_path, "sft", len(long_ids) + 1)
    assert sft_batch(samples, tiny_tokenizer, above)["sample_mask"].tolist() == [1.0, 1.0]
    assert sft_batch(samples, tiny_tokenizer, base)["sample_mask"].tolist() == [1.0, 1.0]
    # the masked batch's NLL and gradient are those of the short sample alone
    width = batch["input_ids"].shape[1]
    logprobs = -torch.rand(2, width, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    logprobs.requires_grad_(True)

    def counts(b):
        valid = b["token_mask"][:, 1:] * b["sample_mask"][:, None]
        return b["sample_mask"].sum(), valid.sum()

    loss, _ = NLLLoss()(logprobs, batch, *counts(batch))
    loss.backward()
    mask = batch["token_mask"][1, 1:].double()
    expected_loss = float(-(logprobs.detach()[1, 1:] * mask).sum() / mask.sum())  # float64, by hand
    assert loss.item() == pytest.approx(expected_loss, rel=1e-12)
    assert (logprobs.grad[0] == 0).all() and (logprobs.grad[1, 1:] == -mask / mask.sum()).all()


def test_a_dpo_pair_longer_than_the_limit_is_masked_and_one_of_exactly_it_is_not(tiny_tokenizer, tmp_path):
    from rlcore.algorithms.dpo.batches import dpo_batch, encoded_pair

    prompt = [{"role": "user", "content": "Name a colour."}]
    pair = Sample(0, prompt, {"chosen": "Blue, or perhaps green.", "rejected": "No."})
    short = Sample(1, [{"role": "user", "content": "hi"}], {"chosen": "yo", "rejected": "no"})
    cfg = offline_cfg(tmp_path, "dpo", None)
    longest = max(sum(len(ids) for ids, _ in chunks) for chunks in encoded_pair(pair, tiny_tokenizer, cfg))
    at = dpo_batch([pair, short], tiny_tokenizer, offline_cfg(tmp_path, "dpo", longest))
    assert at["sample_mask"].tolist() == [1.0] * 4  # NeMo-RL: `max(length) > max_seq_length` is masked
    over = dpo_batch([pair, short], tiny_tokenizer, offline_cfg(tmp_path, "dpo", longest - 1))
    assert over["sample_mask"].tolist() == [0.0, 0.0, 1.0, 1.0]
    for row, chunks in enumerate(encoded_pair(pair, tiny_tokenizer, cfg)):  # both sequences cut per message
        keep = min(4, (longest - 1) // len(chunks))
        assert over["input_ids"][row, : int(over["input_lengths"][row])].tolist() == [
            t for ids, _ in chunks for t in ids[:keep]
        ]
    assert torch.equal(over["input_ids"][2:], at["input_ids"][2:, : over["input_ids"].shape[1]])


# -- the limit against policy.max_total_sequence_length: refused before anything starts ----------------------------


def test_a_limit_above_the_sequence_is_refused_naming_both_paths(tmp_path):
    """A core config rule: the config does not load (so no algorithm, and no `rlcore config validate`, misses it)."""
    from rlcore.config import ConfigError
    from rlcore.config.data import max_input_problem

    with pytest.raises(ConfigError) as err:
        offline_cfg(tmp_path, "sft", 300, max_total=256)
    assert err.value.problems == [
        "data.max_input_seq_length: is 300, above policy.max_total_sequence_length (256): a sample is masked from "
        "this length on, so it must be at most 256; lower it (or leave it null)"
    ]
    assert max_input_problem(offline_cfg(tmp_path, "sft", 256, max_total=256)) is None
    with pytest.raises(ConfigError, match="leaves no room"):
        offline_cfg(tmp_path, "sft", 3, max_total=3)


def test_with_the_limit_a_file_s_long_prompts_are_no_error_before_the_run(tmp_path):
    """Without the field, a prompt that leaves no room is refused with the data (today's check); with it, it is
    cut and masked instead."""
    from rlcore.config import load_config
    from rlcore.datasets import load_sources

    rows = tmp_path / "math.jsonl"
    rows.write_text('{"input": "' + "x" * 80 + '", "output": "1"}\n{"input": "1+1", "output": "2"}\n')
    common = [f"data.train.path={rows}", "policy.max_total_sequence_length=40", "grpo.num_prompts_per_step=2"]

    def length(sample):
        return len(sample.messages[-1]["content"]) + 1

    with pytest.raises(DataError, match="leaves no room for a completion"):
        load_sources(load_config(None, common), length)
    data = load_sources(load_config(None, [*common, "data.max_input_seq_length=20"]), length)
    assert len(data.train.batch(0)) == 2


# -- a real run ---------------------------------------------------------------------------------------------------


def long_and_short_prompts(step: int, n: int, seed: int = 0) -> list[str]:
    """Every other prompt far over the run's limit (the tiny model's tokenizer: about a token per byte)."""
    return [("digits " * 12 if i % 2 else "digits:") for i in range(n)]


@pytest.mark.slow
def test_a_grpo_run_generates_from_the_cut_prompts_and_counts_them(ray_session, tmp_path):
    import json

    from rlcore.run.train import train
    from tests.support.runs import ONE_WORKER, short_run_config

    cfg = short_run_config(
        tmp_path,
        2,
        **ONE_WORKER,
        **{
            "data.train.generator": "tests.algorithms.test_max_input_seq_length:long_and_short_prompts",
            "data.max_input_seq_length": "24",
            "grpo.num_prompts_per_step": "4",
            "policy.train_global_batch_size": "16",
            "checkpointing.enabled": "false",
        },
    )
    train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    for row in rows:
        assert row["cut_prompts"] == 2.0  # of 4 prompts per step, the 2 long ones
        assert np.isfinite(row["loss"]) and row["grad_norm"] > 0  # the short prompts still train
