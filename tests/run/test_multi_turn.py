"""Multi-turn rollouts: the trajectory a turn loop builds (which tokens are trained, where each logprob sits, what
the environment sees and returns), the guessing game's rewards, and real runs in which the tiny model learns
the game over three turns, synchronously and with generation running ahead."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from rlcore.config import load_config
from rlcore.datasets import Sample
from rlcore.environments.guessing import GuessingEnvironment, closeness, guessing_games
from rlcore.interfaces.environment import EnvironmentReturn
from rlcore.run.rollouts import run_rollout
from rlcore.run.step import Timer
from tests.algorithms.test_async_grpo import vllm_missing

EXAMPLE = "examples/grpo_multiturn_tiny.yaml"


class ScriptedEngine:
    """Answers turn t of every row with the tokens ``[100 + t, 200 + t]`` and logprobs ``-(t + 1) / 10, -(t + 1)``,
    recording each request (a stand-in for an engine: the loop's bookkeeping is what is tested here)."""

    def __init__(self) -> None:
        self.requests: list[dict] = []

    def __call__(self, batch):
        self.requests.append({k: batch[k] for k in batch})
        t = len(self.requests) - 1
        ids, lengths = batch["input_ids"], batch["input_lengths"]
        rows, width = ids.shape[0], ids.shape[1] + 2
        out, logprobs = torch.zeros(rows, width, dtype=torch.long), torch.zeros(rows, width)
        for r in range(rows):
            n = int(lengths[r])
            out[r, :n] = ids[r, :n]
            out[r, n : n + 2] = torch.tensor([100 + t, 200 + t])
            logprobs[r, n : n + 2] = torch.tensor([-(t + 1) / 10, -(t + 1.0)])
        return {
            "output_ids": out,
            "logprobs": logprobs,
            "generation_lengths": torch.full((rows,), 2),
            "unpadded_sequence_lengths": lengths + 2,
            "truncated": torch.zeros(rows, dtype=torch.bool),
        }


class CountingEnvironment:
    """Reward 1 per turn; observation ``"ok"`` with stop string ``["!"]``; done at the turn in ``metadata['stop']``."""

    def __init__(self) -> None:
        self.seen: list[tuple[list, list]] = []

    def step(self, logs, metadata):
        self.seen.append(([list(log) for log in logs], [dict(m) for m in metadata]))
        turn = [m.get("turn", 0) + 1 for m in metadata]
        done = [t == m["stop"] for t, m in zip(turn, metadata)]
        return EnvironmentReturn(
            [{"role": "environment", "content": "ok"}] * len(logs),
            [{**m, "turn": t} for m, t in zip(metadata, turn)],
            [1.0] * len(logs),
            done,
            next_stop_strings=[["!"]] * len(logs),
        )


class ByteTokenizer:
    """Text <-> one token per byte (ids 3..258), like the tiny model's."""

    bos_token_id, pad_token_id, chat_template = 1, 0, None

    def encode(self, text, add_special_tokens=False):
        return [b + 3 for b in text.encode()]

    def decode(self, ids, skip_special_tokens=True):
        return bytes(i - 3 for i in ids if 3 <= i < 259).decode(errors="replace")

    def apply_chat_template(self, log, tokenize=False, add_generation_prompt=True, **kwargs):
        return "".join(m["content"] for m in log)


def _cfg(max_turns: int, max_total: int = 64):
    return SimpleNamespace(
        algorithm_section=SimpleNamespace(max_rollout_turns=max_turns),
        policy=SimpleNamespace(max_total_sequence_length=max_total, tokenizer=SimpleNamespace(chat_template_kwargs={})),
    )


def _samples(*stops: int) -> list[Sample]:
    return [Sample(i, [{"role": "user", "content": "hi" * (i + 1)}], {"stop": stop}) for i, stop in enumerate(stops)]


def test_turns_append_completions_and_observations_and_train_only_the_generated_tokens():
    engine, env = ScriptedEngine(), CountingEnvironment()
    rollout = run_rollout(_cfg(3), engine, env, ByteTokenizer(), _samples(1, 3), 1, Timer())
    data, ok = rollout.data, ByteTokenizer().encode("ok")
    prompts = [[1, *ByteTokenizer().encode("hi")], [1, *ByteTokenizer().encode("hihi")]]
    # sample 0 is done after turn 1 (nothing appended after it); sample 1 runs 3 turns, an observation between
    expected = [prompts[0] + [100, 200], prompts[1] + [100, 200] + ok + [101, 201] + ok + [102, 202]]
    for row, seq in enumerate(expected):
        assert data["output_ids"][row, : len(seq)].tolist() == seq
        assert int(data["unpadded_sequence_lengths"][row]) == len(seq)
    assert data["input_lengths"].tolist() == [3, 5] and data["generation_lengths"].tolist() == [2, 6]
    mask = data["token_mask"][1].tolist()
    assert mask == [0] * 5 + [1, 1] + [0, 0] + [1, 1] + [0, 0] + [1, 1] + [0] * (len(mask) - 15)
    assert data["logprobs"][1, 5:15].tolist() == pytest.approx([-0.1, -1, 0, 0, -0.2, -2, 0, 0, -0.3, -3])
    assert rollout.rewards.tolist() == [1.0, 3.0]  # a turn's reward adds to the episode's
    assert rollout.metrics["rollout/turns_mean"] == 2.0 and rollout.metrics["rollout/natural_termination_rate"] == 1
    # turn 2 generated for sample 1 alone, from its tokens so far, with the stop strings the environment gave
    assert engine.requests[1]["input_ids"].tolist() == [prompts[1] + [100, 200] + ok]
    assert engine.requests[1]["stop_strings"] == [["!"]] and "stop_strings" not in engine.requests[0]
    logs, metadata = env.seen[2]
    assert metadata == [{"stop": 3, "turn": 2}]  # the environment's metadata carried to the next turn
    assert [m["role"] for m in logs[0]] == ["user", "assistant", "environment", "assistant", "environment", "assistant"]


def test_a_rollout_ends_at_the_turn_limit_or_when_an_observation_leaves_no_room():
    rollout = run_rollout(_cfg(2), ScriptedEngine(), CountingEnvironment(), ByteTokenizer(), _samples(9), 1, Timer())
    assert rollout.data["generation_lengths"].tolist() == [4] and rollout.rewards.tolist() == [2.0]
    assert rollout.metrics["rollout/natural_termination_rate"] == 0 and rollout.metrics["rollout/truncation_rate"] == 0
    # 3 prompt + 2 generated + 2 observed leaves no room within 7: the episode ends, truncated, after one turn
    short = run_rollout(
        _cfg(3, max_total=7), ScriptedEngine(), CountingEnvironment(), ByteTokenizer(), _samples(9), 1, Timer()
    )
    assert short.data["unpadded_sequence_lengths"].tolist() == [5] and short.metrics["rollout/truncation_rate"] == 1


def test_one_turn_is_the_single_completion_each_repeated_sample_gets():
    rollout = run_rollout(_cfg(1), ScriptedEngine(), CountingEnvironment(), ByteTokenizer(), _samples(5, 5), 2, Timer())
    data = rollout.data
    assert data["input_lengths"].tolist() == [3, 3, 5, 5]
    for row, start in enumerate([3, 3, 5, 5]):
        assert data["token_mask"][row].nonzero().flatten().tolist() == [start, start + 1]
    assert rollout.rewards.tolist() == [1.0] * 4 and "rollout/turns_mean" not in rollout.metrics


def test_the_guessing_game_rewards_the_last_guess_and_ends_on_the_secret():
    env = GuessingEnvironment()
    meta = {"ground_truth": "6"}
    log = [{"role": "user", "content": "guess a digit:"}]
    rewards, hints = [], []
    for guess in ("x", "2", "9", "6"):
        log = [*log, {"role": "assistant", "content": guess}]
        result = env.step([log], [meta])
        rewards.append(result.rewards[0])
        hints.append(result.observations[0]["content"])
        meta = result.metadata[0] or meta
    assert hints == [" a digit:", " higher:", " lower:", ""] and result.terminateds == [True]
    assert rewards == pytest.approx([0.0, 5 / 9, 1 / 9, 3 / 9])  # closeness 0, then 5/9 (|2-6|=4), 6/9 (3), 1
    assert sum(rewards[:3]) == pytest.approx(closeness("9", 6))  # stopped after any turn: the last guess's closeness
    games = guessing_games(3, 50, seed=1)
    assert games == guessing_games(3, 50, seed=1) and len({g["output"] for g in games}) > 5


def multi_turn_config(tmp_path, steps: int, *extra: str):
    return load_config(
        EXAMPLE,
        [
            "policy.backend=reference",
            f"grpo.max_num_steps={steps}",
            f"logger.output_dir={tmp_path}",
            "logger.progress_bar=false",
            "checkpointing.enabled=false",
            *extra,
        ],
    )


ASYNC = [
    "cluster.workers_per_node=1",
    "policy.generation.colocated={enabled: false, resources: {num_nodes: 1, workers_per_node: 1}}",
    "grpo.async_grpo.enabled=true",
    "loss.use_importance_sampling_correction=true",
]


@pytest.mark.skipif(vllm_missing(), reason="needs rl-vllm")
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_tiny_model_learns_the_guessing_game_over_three_turns(ray_session, tmp_path, monkeypatch, mode):
    """Asynchronous: the engine is also SIGKILLed in the first rollout's third turn; the rollout thread
    restarts it, refits it by broadcast into a new refit group, and the run learns as before."""
    from rlcore.run.train import train
    from tests.run.test_engine_recovery import kill_an_engine_mid_request

    killed = kill_an_engine_mid_request(monkeypatch) if mode == "async" else []
    train(multi_turn_config(tmp_path, 36, *(ASYNC if mode == "async" else [])))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    if mode == "async":
        assert len(killed) == 1 and {r["engine/restarts"] for r in rows} == {1.0}, (killed, rows[0])
    first, last = (sum(r["reward_mean"] for r in part) / len(part) for part in (rows[:6], rows[-6:]))
    assert last > first + 0.3, (first, last)
    assert rows[0]["rollout/turns_mean"] > 2.5  # the untrained model rarely guesses right: most episodes go on
    # The engine's logprobs sit at the policy's positions in every turn: on the weights that sampled it, the
    # trainer scores the trajectory as the engine did (a shift by one token would be far off).
    on_policy = rows if mode == "sync" else rows[:1]
    assert all(abs(r["token_mult_prob_error"] - 1) < 1e-3 for r in on_policy), [
        r["token_mult_prob_error"] for r in on_policy
    ]
    if mode == "async":
        assert max(r["async/age_max"] for r in rows) == 1 and all(r["async/regenerated_rollouts"] == 0 for r in rows)
