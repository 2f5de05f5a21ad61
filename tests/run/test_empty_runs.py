"""A run that would train nothing is an error (issue 45, item 2): every SFT sample cut at
``policy.max_total_sequence_length``, every DPO pair cut, or chosen equal to rejected. A file that shows it stops
the run before anything starts (``load_data``); a step that shows it stops the run before its optimizer step."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from rlcore.algorithms.dpo.loop import dpo_step
from rlcore.algorithms.sft.batches import conversation, encode_conversation
from rlcore.algorithms.sft.loop import offline_train, sft_step
from rlcore.datasets import DataError
from rlcore.run.build import load_run_data
from rlcore.run.errors import RunError
from tests.algorithms.test_dpo_run import dpo_config
from tests.algorithms.test_sft import sft_config


def sample_lengths(cfg, tokenizer, samples) -> list[int]:
    return [len(encode_conversation(tokenizer, conversation(s), cfg.sft)[0]) for s in samples]


class NoTraining:
    """A policy a step must not reach: the step stops before it trains."""

    def __getattr__(self, name):
        raise AssertionError(f"the step reached policy.{name} although it trains nothing")


def run_of(cfg, tokenizer, batches):
    """Just what a loop reads of a run: its config, tokenizer, steps, data position and batches (no Ray, no
    policy)."""
    draws = iter(batches)
    return SimpleNamespace(
        cfg=cfg,
        tokenizer=tokenizer,
        start_step=3,
        num_steps=5,
        next_batch=3,
        policy=NoTraining(),
        draw_train_batch=lambda: next(draws),
    )


def stopped_step(run, step_fn) -> str:
    with pytest.raises(RunError) as caught:
        offline_train(
            run, lambda step, metrics: pytest.fail("a step that trains nothing was logged"), step_fn, lambda run: {}
        )
    return str(caught.value)


def test_an_sft_file_whose_samples_are_all_cut_stops_before_anything_starts(tiny_tokenizer, tmp_path):
    cfg = sft_config(tmp_path, **{"policy.max_total_sequence_length": "16"})
    samples = load_run_data(sft_config(tmp_path), tiny_tokenizer).train.samples  # read with room to spare
    lengths = sample_lengths(cfg, tiny_tokenizer, samples)
    assert min(lengths) > 16
    with pytest.raises(DataError) as caught:
        load_run_data(cfg, tiny_tokenizer)
    assert str(caught.value) == (
        f"data.train: all 8 samples are longer than policy.max_total_sequence_length=16 ({min(lengths)} to "
        f"{max(lengths)} tokens), so each is cut and trains nothing; raise policy.max_total_sequence_length (to "
        f"{max(lengths)} to keep them all) or shorten them"
    )
    # one sample that fits is enough to start: the steps without one stop on their own
    limit = str(min(lengths))
    assert load_run_data(sft_config(tmp_path, **{"policy.max_total_sequence_length": limit}), tiny_tokenizer)


def test_an_sft_step_whose_samples_are_all_cut_stops_the_run_naming_the_step(tiny_tokenizer, tmp_path):
    cfg = sft_config(tmp_path)
    data = load_run_data(cfg, tiny_tokenizer).train
    fits = data.batch(0)
    long = [
        SimpleNamespace(
            **{
                **vars(s),
                "messages": [
                    {"role": "user", "content": "x" * 80},
                    {"role": "assistant", "content": "y" * (10 + s.idx)},
                ],
            }
        )
        for s in data.batch(1)
    ]
    lengths = sample_lengths(cfg, tiny_tokenizer, long)
    assert min(lengths) > 64
    message = stopped_step(run_of(cfg, tiny_tokenizer, [long]), sft_step)
    assert message == (
        f"step 3: all 4 samples are longer than policy.max_total_sequence_length=64 ({min(lengths)} "
        f"to {max(lengths)} tokens), so each is cut and trains nothing; raise "
        f"policy.max_total_sequence_length (to {max(lengths)} to keep them all) or shorten them"
    )
    with pytest.raises(AssertionError, match="reached policy"):  # a batch with one sample that fits trains
        sft_step(run_of(cfg, tiny_tokenizer, [long[:3] + fits[:1]]))


def write_pairs(tmp_path, pairs) -> str:
    path = tmp_path / "given_pairs.jsonl"  # dpo_config writes pairs.jsonl
    path.write_text("".join(json.dumps({"prompt": p, "chosen": c, "rejected": r}) + "\n" for p, c, r in pairs))
    return str(path)


def test_a_dpo_file_whose_pairs_are_all_equal_or_cut_stops_before_anything_starts(tiny_tokenizer, tmp_path):
    same = [(f"reverse {w}", w[::-1], w[::-1]) for w in ("abc", "bcd", "cab", "dab")]
    cfg = dpo_config(tmp_path, **{"data.train.path": write_pairs(tmp_path, same), "dpo.sft_loss_weight": "0"})
    with pytest.raises(DataError) as caught:
        load_run_data(cfg, tiny_tokenizer)
    assert str(caught.value) == (
        "data.train: in all 4 pairs the chosen response equals the rejected one, so the "
        "preference loss has nothing to learn; give each pair two different responses"
    )
    # with an SFT term the chosen responses still train
    assert load_run_data(dpo_config(tmp_path, **{"data.train.path": write_pairs(tmp_path, same)}), tiny_tokenizer)

    long = [(f"reverse {w}" * 8, w, w[::-1]) for w in ("abc", "bcd", "cab", "dab")]
    cfg = dpo_config(
        tmp_path, **{"data.train.path": write_pairs(tmp_path, same[:2] + long[:2]), "dpo.sft_loss_weight": "0"}
    )
    with pytest.raises(
        DataError,
        match=r"^data.train: none of its 4 pairs trains anything: 2 have the chosen "
        r"response equal to the rejected one, 2 are longer than "
        r"policy.max_total_sequence_length=64 \(\d+ to \d+ tokens\) and cut; give "
        r"each pair two different responses, and raise",
    ):
        load_run_data(cfg, tiny_tokenizer)
    cfg = dpo_config(tmp_path, **{"data.train.path": write_pairs(tmp_path, long)})
    with pytest.raises(
        DataError,
        match=r"^data.train: all 4 pairs are longer than "
        r"policy.max_total_sequence_length=64 \(\d+ to \d+ tokens\), so each is cut",
    ):
        load_run_data(cfg, tiny_tokenizer)


def test_a_dpo_step_without_a_pair_that_trains_stops_the_run_naming_the_step(tiny_tokenizer, tmp_path):
    cfg = dpo_config(tmp_path, **{"dpo.sft_loss_weight": "0"})
    pairs = load_run_data(cfg, tiny_tokenizer).train.batch(0)
    same = [SimpleNamespace(**{**vars(s), "metadata": {**s.metadata, "rejected": s.metadata["chosen"]}}) for s in pairs]
    message = stopped_step(run_of(cfg, tiny_tokenizer, [same]), dpo_step)
    assert message == (
        "step 3: in all 4 pairs the chosen response equals the rejected one, so the preference "
        "loss has nothing to learn; give each pair two different responses"
    )
    with pytest.raises(AssertionError, match="reached policy"):  # one differing pair trains
        dpo_step(run_of(cfg, tiny_tokenizer, [same[:3] + pairs[3:]]))
