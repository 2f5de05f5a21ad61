"""The GRPO loop behind ``rlcore run``: its pieces against hand computations, and short real runs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from rlcore.algorithms.grpo.advantages import group_advantages
from rlcore.config import load_config
from rlcore.environments.digits import digit_prompts, digit_reward
from rlcore.run.step import encode_prompts, training_batch
from tests.support.runs import ONE_WORKER, generation_backend, short_run_config


def test_leave_one_out_and_mean_std_advantages():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.2, 0.2, 0.8])
    loo = group_advantages(rewards, 3, "leave_one_out")
    expected = [1.0 - 0.25, 0.0 - 0.75, 0.5 - 0.5, 0.2 - 0.5, 0.2 - 0.5, 0.8 - 0.2]
    torch.testing.assert_close(loo, torch.tensor(expected), atol=1e-6, rtol=0)
    ms = group_advantages(rewards, 3, "mean_std")
    group = rewards[:3].double()
    torch.testing.assert_close(ms[:3].double(), (group - group.mean()) / (group.std() + 1e-6), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="whole groups"):
        group_advantages(rewards, 4)


@pytest.mark.parametrize("minus_baseline", [False, True])
@pytest.mark.parametrize("with_kl", [False, True])
def test_reinforce_plus_plus_advantages_against_a_float64_recomputation(minus_baseline, with_kl):
    """NeMo-RL's estimator: r (minus the group mean) minus beta * KL per token, whitened over every valid token."""
    from rlcore.algorithms.grpo.advantages import reinforce_plus_plus_advantages

    gen = torch.Generator().manual_seed(0)
    rewards = torch.rand(6, generator=gen)
    mask = torch.zeros(6, 7)
    for row, (start, end) in enumerate([(2, 7), (3, 5), (1, 4), (2, 6), (4, 7), (1, 2)]):
        mask[row, start:end] = 1
    kl = torch.rand(6, 7, generator=gen) if with_kl else None
    adv = reinforce_plus_plus_advantages(rewards, 3, mask, minus_baseline, kl, kl_coef=0.3)
    values = {}
    for b in range(6):
        group = [float(r) for r in rewards[(b // 3) * 3 : (b // 3) * 3 + 3]]
        base = float(rewards[b]) - (sum(group) / 3 if minus_baseline else 0.0)
        for t in range(7):
            if mask[b, t]:
                values[b, t] = base - (0.3 * float(kl[b, t]) if with_kl else 0.0)
    mean = sum(values.values()) / len(values)
    std = (sum((v - mean) ** 2 for v in values.values()) / len(values)) ** 0.5
    expected = torch.zeros(6, 7, dtype=torch.float64)
    for (b, t), v in values.items():
        expected[b, t] = (v - mean) / std
    torch.testing.assert_close(adv.double(), expected, atol=2e-6, rtol=0)


def test_kl_in_reward_takes_the_kl_out_of_the_loss():
    from rlcore.algorithms.grpo.loss import ClippedPGLossFn

    data = {
        "token_mask": torch.tensor([[0.0, 1.0, 1.0]]),
        "sample_mask": torch.ones(1),
        "advantages": torch.tensor([[0.0, 1.0, -1.0]]),
        "prev_logprobs": torch.tensor([[0.0, -1.0, -2.0]]),
    }
    logprobs = torch.tensor([[0.0, -0.9, -2.1]])
    plain = ClippedPGLossFn({})(logprobs, data, torch.tensor(1.0), torch.tensor(2.0))
    in_reward = ClippedPGLossFn({"use_kl_in_reward": True, "reference_policy_kl_penalty": 0.5})(
        logprobs, data, torch.tensor(1.0), torch.tensor(2.0)
    )  # no reference logprobs needed
    assert in_reward[0] == plain[0] and in_reward[1]["kl_penalty"] == 0.0


def test_toy_task_is_reproducible_and_scores_digits():
    assert digit_prompts(3, 5, seed=1) == digit_prompts(3, 5, seed=1) != digit_prompts(4, 5, seed=1)
    assert digit_reward(["p"] * 3, ["1234", "a1b2", ""]) == [1.0, 0.5, 0.0]


def test_training_batch_trains_only_generated_tokens(tiny_tokenizer):
    batch = encode_prompts(tiny_tokenizer, ["ab", "abcd"], repeat=2)
    assert batch["input_ids"].shape[0] == 4 and batch["input_lengths"].tolist() == [3, 3, 5, 5]  # BOS + bytes
    mask = torch.zeros(4, 9)
    mask[0, 3:5] = mask[2, 5:9] = mask[3, 5:6] = 1  # the generated tokens (row 1 generated none)
    rollout = {
        "output_ids": torch.zeros(4, 9, dtype=torch.long),
        "unpadded_sequence_lengths": torch.tensor([5, 3, 9, 6]),
        "logprobs": torch.zeros(4, 9),
        "token_mask": mask,
    }
    data = training_batch(rollout, torch.tensor([1.0, -1.0, 0.5, 2.0]))
    assert data["token_mask"] is mask and data["input_lengths"].tolist() == [5, 3, 9, 6]
    assert data["advantages"][0].tolist() == [0, 0, 0, 1.0, 1.0, 0, 0, 0, 0] and data["advantages"][1].sum() == 0
    assert data["advantages"][3].tolist() == [0, 0, 0, 0, 0, 2.0, 0, 0, 0]


def test_rollout_must_fill_whole_global_batches():
    from rlcore.config import ConfigError

    with pytest.raises(ConfigError, match=r"grpo.num_prompts_per_step × grpo.num_generations_per_prompt = 3 × 4"):
        load_config("examples/grpo_tiny.yaml", ["grpo.num_prompts_per_step=3"])


def test_bad_config_fails_before_anything_starts(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlcore",
            "run",
            "examples/grpo_tiny.yaml",
            "-o",
            "grpo.max_num_step=3",
            "-o",
            "policy.generation.backend=vlm",
            "-o",
            f"logger.output_dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == ["grpo.max_num_step: unknown key; did you mean 'max_num_steps'?"]
    assert not (tmp_path / "metrics.jsonl").exists()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlcore",
            "run",
            "examples/grpo_tiny.yaml",
            "-o",
            "policy.generation.backend=vlm",
            "-o",
            "policy.backend=reference",
            "-o",
            f"logger.output_dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1 and "no backend named 'vlm'" in out.stderr and "Traceback" not in out.stderr


def test_short_run_writes_metrics_and_a_checkpoint(ray_session, tmp_path, monkeypatch):
    """With vLLM, an engine is also SIGKILLed mid-refit and mid-generation in step 0: restarted each time
    (docs/engine-faults.md), the run's numbers below are those of a run without deaths."""
    from transformers import AutoModelForCausalLM

    from rlcore.run.checkpoints import latest_step
    from rlcore.run.train import train
    from tests.run.test_engine_recovery import kill_an_engine_mid_refit_and_mid_generation

    killed = kill_an_engine_mid_refit_and_mid_generation(monkeypatch) if generation_backend() == "vllm" else []
    summary = train(short_run_config(tmp_path, 2, **{"policy.generation.engine_restarts_per_step": "2"}))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1] and summary["steps"] == 2
    if killed:  # one restart per death, both in step 0; the run goes on with every step
        assert len(killed) == 2 and [r["engine/restarts"] for r in rows] == [2.0, 2.0], (killed, rows)
    for key in (
        "reward_mean",
        "reward_std",
        "loss",
        "grad_norm",
        "kl_penalty",
        "token_mult_prob_error",
        "tokens_per_s",
        "time/generation_s",
        "time/logprob_s",
        "time/train_s",
        "time/step_s",
    ):
        assert key in rows[0], key
    assert all(abs(r["token_mult_prob_error"] - 1.0) < 1e-3 for r in rows), rows  # engine == trainer
    # the engine/trainer gap metrics beside it (rlcore.algorithms.grpo.off_policy): no gap here either
    for r in rows:
        assert 0 <= r["rollout_probs_diff_mean"] <= r["rollout_probs_diff_max"] < 1e-3, r
        assert abs(r["k3_kl"]) < 1e-5 and r["rollout_actor_probs_pearson_corr"] > 0.999, r
    # vLLM: a refit before every step, the whole model each time; fsdp1 generates from its own weights
    refits, vllm = [r["refit_bytes"] for r in rows], generation_backend() == "vllm"
    assert refits == ([refits[0]] * 2 if vllm else [0.0, 0.0]) and (refits[0] > 0) == vllm, refits
    if vllm:  # verified refits (rl-vllm declares verified_refit): step s samples from weight_version s, restarts too
        assert [r["weight_version"] for r in rows] == [0, 1], rows
    # peak RSS per role: a worker holds torch + the model (> 100 MiB) in well under this machine's memory
    for role in ("train", "generation"):
        peaks = [r[f"memory/{role}_peak_rss_gib"] for r in rows]
        assert 0.1 < peaks[0] <= peaks[1] < 24, (role, peaks)  # a peak so far never goes down
    assert (tmp_path / "reward_curve.png").stat().st_size > 1000
    step, ckpt = latest_step(tmp_path / "checkpoints")
    assert step == 1
    AutoModelForCausalLM.from_pretrained(ckpt / "weights")  # the final weights load with HF
    # Resuming: tests/cli/test_run_lifecycle.py (the CLI, one metrics row per step), the test below (the state),
    # and the conformance kit (exact resume of every backend).


def test_a_reinforce_plus_plus_run_with_the_kl_in_the_reward_and_vapo(ray_session, tmp_path):
    from rlcore.run.train import train

    cfg = short_run_config(
        tmp_path,
        1,
        **ONE_WORKER,
        **{
            "grpo.advantage_estimator": "reinforce_plus_plus_baseline",
            "loss.use_kl_in_reward": "true",
            "loss.reference_policy_kl_penalty": "0.05",
            "loss.positive_example_nll_weight": "0.1",
        },
    )
    train(cfg)
    (row,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # the KL went into the advantages (the prev-logprob pass ran for it), not into the loss
    assert row["prev_logprobs_pass"] == 1.0 and row["kl_penalty"] == 0.0
    # the loop gave the loss its rewards and token counts (toy rewards are in [0, 1])
    assert (row["positive_nll_loss"] > 0) == (row["reward_mean"] > 0)
    assert torch.isfinite(torch.tensor([row["loss"], row["grad_norm"]])).all() and row["grad_norm"] > 0


@pytest.mark.slow  # the kit's checkpoint round trip checks the same state per backend, in make test
def test_resumed_policy_has_the_checkpointed_weights(ray_session, tmp_path, tiny_tokenizer):
    """The state a checkpoint restores is the state that was saved: same logprobs, same next step."""
    from rlcore.algorithms.grpo.loop import grpo_train
    from rlcore.data import BatchedDataDict
    from rlcore.models import resolve_builtin_models
    from rlcore.run.build import build_run
    from rlcore.run.checkpoints import save_step
    from rlcore.testing.models import make_batch

    cfg = resolve_builtin_models(short_run_config(tmp_path, 1))
    probe = BatchedDataDict(make_batch(tiny_tokenizer, 4, 4, 12, seed=5))
    run = build_run(cfg)
    try:
        grpo_train(run, lambda step, metrics: None)
        saved = save_step(run.policy, tmp_path / "ck", 0, keep_last=1)
        before = run.policy.get_logprobs(probe)["logprobs"]
    finally:
        run.shutdown()
    run = build_run(cfg, resume_dir=saved, start_step=1)
    try:
        torch.testing.assert_close(run.policy.get_logprobs(probe)["logprobs"], before, atol=1e-6, rtol=0)
    finally:
        run.shutdown()


def test_reward_rises_well_above_random_on_a_fixed_seed(ray_session, tmp_path):
    from rlcore.run.train import train

    # 20 of the demo's 30 steps: the mean reward is ~0.8 by then on this seed (0.05 at the start)
    summary = train(short_run_config(tmp_path, 20, **ONE_WORKER, **{"checkpointing.enabled": "false"}))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    first, last = sum(r["reward_mean"] for r in rows[:3]) / 3, sum(r["reward_mean"] for r in rows[-3:]) / 3
    assert first < 0.15 and last > 0.6, (first, last, summary)


def test_chat_template_where_prompts_are_built(tiny_tokenizer, tmp_path):
    """policy.tokenizer.chat_template, NeMo-RL's values: null = passthrough, 'default' = the tokenizer's own,
    '*.jinja' = that file, else a template string; each prompt is one user message with the generation prompt."""
    import copy

    from rlcore.config import ConfigError, TokenizerConfig
    from rlcore.run.prompts import configure_tokenizer, render_prompts

    def formatted(template, **kwargs):
        tok = configure_tokenizer(copy.deepcopy(tiny_tokenizer), TokenizerConfig(name="tiny", chat_template=template))
        return render_prompts(tok, [[{"role": "user", "content": "write 12"}]], kwargs or None)[0], tok

    assert formatted(None)[0] == "write 12"
    text, tok = formatted("default")
    assert text == "<s><|user|>\nwrite 12</s>\n<|assistant|>\n"
    assert encode_prompts(tok, [text], 1)["input_ids"][0].tolist().count(tok.bos_token_id) == 1  # BOS once
    assert formatted("[{{ messages[0]['content'] }}]{% if flag %}!{% endif %}", flag=True)[0] == "[write 12]!"
    (tmp_path / "t.jinja").write_text("T:{{ messages[0]['content'] }}")
    assert formatted(str(tmp_path / "t.jinja"))[0] == "T:write 12"
    bare = copy.deepcopy(tiny_tokenizer)
    bare.chat_template = None
    with pytest.raises(
        ConfigError,
        match=r"policy.tokenizer.chat_template: is 'default' but the tokenizer 'x' has "
        r"no chat template",
    ):
        configure_tokenizer(bare, TokenizerConfig(name="x", chat_template="default"))


def test_completions_are_cut_to_max_total_sequence_length():
    from rlcore.run.prompts import check_prompt_room, clip_rollout

    prompt_lengths = torch.tensor([3, 5])
    rollout = {
        "output_ids": torch.arange(1, 21).view(2, 10),
        "logprobs": -torch.ones(2, 10),
        "generation_lengths": torch.tensor([6, 2]),
        "unpadded_sequence_lengths": torch.tensor([9, 7]),
        "truncated": torch.tensor([False, False]),
    }
    out = clip_rollout(dict(rollout), prompt_lengths, 8, pad_id=0)
    assert out["generation_lengths"].tolist() == [5, 2] and out["unpadded_sequence_lengths"].tolist() == [8, 7]
    assert out["output_ids"].shape == (2, 8) and out["output_ids"][1, 7] == 0 and out["logprobs"][1, 7] == 0
    assert out["truncated"].tolist() == [True, False]
    assert clip_rollout(dict(rollout), prompt_lengths, 10, pad_id=0)["output_ids"].shape == (2, 10)  # untouched
    with pytest.raises(ValueError, match="a prompt of 5 tokens leaves no room"):
        check_prompt_room(prompt_lengths, 5)
