"""GDPO (``grpo.advantage_estimator: gdpo``): the estimator against a float64 recomputation, the named reward
components environments return (checked, joined, summed over turns, logged), the python environment's named
rewards, the config's rules, NeMo-RL's ``adv_estimator.name: gdpo``, and a short real run."""

from __future__ import annotations

import json
from statistics import mean, stdev
from types import SimpleNamespace

import pytest
import torch

from rlcore.algorithms.grpo.advantages import gdpo_advantages
from rlcore.algorithms.grpo.step import gdpo_step_advantages, reward_components
from rlcore.config import ConfigError, load_config
from rlcore.environments.runner import EnvironmentRunner, isolated_step
from rlcore.interfaces.environment import EnvironmentReturn
from rlcore.run.rollouts import run_rollout
from rlcore.run.step import Timer
from tests.run.test_multi_turn import ByteTokenizer, CountingEnvironment, ScriptedEngine, _samples

# -- the estimator -------------------------------------------------------------------------------------------

#: 3 prompts × 4 completions. "correct": a mixed group, a group whose leave-one-out pools have std 0 for the
#: others of the 1, and a constant group; "format": real-valued, one group constant; "zero": constant everywhere.
COMPONENTS = {
    "correct": [1, 0, 1, 0, 1, 0, 0, 0, 1, 1, 1, 1],
    "format": [0.2, 0.9, 0.5, 0.4, 0.3, 0.3, 0.3, 0.3, 0.0, 1.0, 0.75, 0.1],
    "zero": [0.3] * 12,
}


def recomputed(components, group_size, leave_one_out, normalize, weights):
    """GDPO in plain Python floats, one sample at a time (NeMo-RL's GDPOAdvantageEstimator, read off its code)."""
    names = sorted(components)
    weights = weights or [1.0] * len(names)
    size = len(components[names[0]])
    total = [0.0] * size
    for name, weight in zip(names, weights):
        rewards = [float(r) for r in components[name]]
        for start in range(0, size, group_size):
            group = rewards[start : start + group_size]
            for j, r in enumerate(group):
                pool = group[:j] + group[j + 1 :] if leave_one_out else group
                adv = r - mean(pool)
                std = stdev(pool) if len(pool) > 1 else 0.0
                if normalize and std > 0:
                    adv /= std + 1e-6
                total[start + j] += weight * adv
    centre, spread = mean(total), stdev(total)
    return [(t - centre) / spread if spread > 0 else t - centre for t in total]


@pytest.mark.parametrize("weights", [None, [0.5, 2.0, 3.0]], ids=["equal", "weighted"])
@pytest.mark.parametrize("normalize", [True, False], ids=["normalized", "raw"])
@pytest.mark.parametrize("leave_one_out", [True, False], ids=["loo", "mean"])
def test_gdpo_against_a_float64_recomputation(leave_one_out, normalize, weights):
    tensors = {name: torch.tensor(values, dtype=torch.float32) for name, values in COMPONENTS.items()}
    adv = gdpo_advantages(tensors, 4, leave_one_out, normalize, weights)
    expected = recomputed({n: tensors[n].tolist() for n in tensors}, 4, leave_one_out, normalize, weights)
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv.double(), torch.tensor(expected, dtype=torch.float64), atol=2e-6, rtol=0)
    assert abs(float(adv.mean())) < 1e-6 and abs(float(adv.std()) - 1) < 1e-5  # standardized over the batch


def test_gdpo_weights_follow_the_sorted_names_and_no_signal_gives_zeros():
    a = torch.tensor([1.0, 0.0, 0.0, 0.0])
    b = torch.tensor([0.0, 0.0, 1.0, 0.0])
    # only b counts: the dict's order is not the weights' order, the names' is
    only_b = gdpo_advantages({"b": b, "a": a}, 4, weights=[0.0, 1.0])
    torch.testing.assert_close(only_b, gdpo_advantages({"a": torch.zeros(4), "b": b}, 4))
    assert int(only_b.argmax()) == 2
    # every group constant in every component: exactly 0, not rounding noise blown up by the standardization
    flat = gdpo_advantages({"x": torch.full((8,), 0.1), "y": torch.full((8,), 0.7)}, 4, leave_one_out=True)
    assert flat.tolist() == [0.0] * 8


def test_gdpo_needs_two_components_and_one_weight_each():
    with pytest.raises(ValueError, match=r"at least 2 reward components, got 1: \['a'\]"):
        gdpo_advantages({"a": torch.ones(4)}, 2)
    with pytest.raises(ValueError, match="3 reward weights for 2 reward components"):
        gdpo_advantages({"a": torch.ones(4), "b": torch.ones(4)}, 2, weights=[1, 1, 1])


def _step_cfg(weights=None, scaling=False):
    scale = SimpleNamespace(enabled=scaling, source_min=0.0, source_max=1.0, target_min=-1.0, target_max=1.0)
    gdpo = SimpleNamespace(use_leave_one_out_baseline=False, normalize_rewards=True, reward_weights=weights)
    return SimpleNamespace(
        env=SimpleNamespace(name="math"),
        grpo=SimpleNamespace(num_generations_per_prompt=2, gdpo=gdpo, reward_scaling=scale),
    )


def test_a_step_names_the_environment_when_gdpo_cannot_run():
    with pytest.raises(
        ValueError,
        match="gdpo needs at least 2 named reward components per sample, but environment "
        "'math' returns none .* set grpo.advantage_estimator to leave_one_out_std "
        "or mean_std",
    ):
        gdpo_step_advantages(_step_cfg(), {})
    with pytest.raises(ValueError, match=r"returns 1 \(accuracy\)"):
        gdpo_step_advantages(_step_cfg(), {"accuracy": torch.ones(4)})
    with pytest.raises(
        ValueError,
        match="grpo.gdpo.reward_weights: has 1 entries, but environment 'math' returns 2 "
        "reward components: accuracy, format",
    ):
        gdpo_step_advantages(_step_cfg([1.0]), {"format": torch.ones(4), "accuracy": torch.ones(4)})


def test_reward_scaling_scales_each_component_first():
    components = {"a": torch.tensor([0.0, 2.0, 0.5, 0.25]), "b": torch.tensor([1.0, 0.0, -3.0, 0.0])}
    scaled = {"a": torch.tensor([-1.0, 1.0, 0.0, -0.5]), "b": torch.tensor([1.0, -1.0, -1.0, -1.0])}  # clamped
    torch.testing.assert_close(gdpo_step_advantages(_step_cfg(scaling=True), components), gdpo_advantages(scaled, 2))


# -- what environments return ----------------------------------------------------------------------------------


def _logs(*completions):
    return [[{"role": "user", "content": "q"}, {"role": "assistant", "content": c}] for c in completions]


def test_reward_components_are_checked_and_sorted():
    out = EnvironmentReturn.from_components({"format": [1, 0], "accuracy": [0.5, 1]}, [{}, {}])
    assert list(out.reward_components) == ["accuracy", "format"] and out.rewards == [1.5, 1.0]
    assert EnvironmentReturn.final([1.0], [{}]).reward_components is None
    bad = [
        ({"a": [1.0]}, "reward_components\\['a'\\]: needs one entry per sample, got 1 for 2"),
        ({"reward/a": [1.0, 0.0]}, "'reward/a' is not a component name"),
        ({"": [1.0, 0.0]}, "'' is not a component name"),
        ({}, "is empty"),
        ([[1.0, 0.0]], "expected a dict"),
    ]
    for components, message in bad:
        with pytest.raises(ValueError, match=message):
            EnvironmentReturn.final([1.0, 0.0], [{}, {}], reward_components=components)


class TwoScores:
    """Named rewards "len" and "x"; raises on a batch holding "boom"."""

    def __init__(self, config=None):
        pass

    def step(self, message_logs, metadata):
        texts = [log[-1]["content"] for log in message_logs]
        if "boom" in texts:
            raise RuntimeError("verifier crashed")
        return EnvironmentReturn.from_components(
            {"x": [float("x" in t) for t in texts], "len": [len(t) / 10 for t in texts]}, metadata
        )


def test_joined_results_keep_the_components_and_a_failed_sample_scores_zero():
    out = isolated_step(TwoScores(), _logs("xx", "boom", "abc"), [{}, {}, {}])  # retried one sample at a time
    assert out.reward_components == {"len": [0.2, 0.0, 0.3], "x": [1.0, 0.0, 0.0]}
    assert out.rewards == [1.2, 0.0, 0.3] and out.errors[1] == "RuntimeError: verifier crashed"
    plain = EnvironmentReturn.final([1.0], [{}])  # scored, but without components
    with pytest.raises(ValueError, match="others, scored without an error, have none"):
        EnvironmentReturn.concat([TwoScores().step(_logs("x"), [{}]), plain])
    other = EnvironmentReturn.from_components({"y": [1.0], "len": [0.0]}, [{}])
    with pytest.raises(ValueError, match="different component names"):
        EnvironmentReturn.concat([TwoScores().step(_logs("x"), [{}]), other])


def test_components_survive_environment_actors(ray_session):
    runner = EnvironmentRunner("two", "tests.algorithms.test_gdpo:TwoScores", None, num_workers=2)
    try:
        out = runner.step(_logs("x", "ab", "xyz", "q"), [{}] * 4)
    finally:
        runner.shutdown()
    assert out.reward_components == {"len": [0.1, 0.2, 0.3, 0.1], "x": [1.0, 0.0, 1.0, 0.0]}


def named_rewards(prompts, completions, metadata, bonus=0.0):
    """The python environment's named rewards: the completion has the answer; it is short."""
    return {
        "answer": [float(str(m["ground_truth"]) in c) + bonus for c, m in zip(completions, metadata)],
        "short": [float(len(c) <= 3) for c in completions],
    }


def test_the_python_environment_returns_named_rewards_and_their_sum():
    from rlcore.environments.python_reward import PythonRewardConfig
    from rlcore.plugins import get_registry
    from rlcore.testing.environment_kit import check_environment

    config = PythonRewardConfig(reward="tests.algorithms.test_gdpo:named_rewards", kwargs={"bonus": 0.5})
    spec = get_registry().resolve_environment("python")
    out = EnvironmentRunner("python", spec.environment_class, config).step(
        _logs("7", "it is 7", "8"), [{"ground_truth": 7}] * 3
    )
    assert out.reward_components == {"answer": [1.5, 1.5, 0.5], "short": [1.0, 0.0, 1.0]}
    assert out.rewards == [2.5, 1.5, 1.5]
    assert check_environment(spec, config, [("7", {"ground_truth": 7}), ("", {"ground_truth": 1})]) == []


class ComponentCounting(CountingEnvironment):
    """CountingEnvironment whose reward 1 per turn is "turn" plus a "first" that only the first turn earns."""

    def step(self, logs, metadata):
        out = super().step(logs, metadata)
        first = [float(m.get("turn") == 1) for m in out.metadata]
        out.reward_components = {"first": first, "turn": [1.0] * len(logs)}
        out.rewards = [1.0 + f for f in first]
        return out


def _rollout_cfg(max_turns: int) -> SimpleNamespace:
    turns = SimpleNamespace(max_rollout_turns=max_turns)
    return SimpleNamespace(
        grpo=turns,
        algorithm_section=turns,
        policy=SimpleNamespace(max_total_sequence_length=64, tokenizer=SimpleNamespace(chat_template_kwargs={})),
    )


def test_components_add_up_over_turns_like_rewards():
    rollout = run_rollout(
        _rollout_cfg(3), ScriptedEngine(), ComponentCounting(), ByteTokenizer(), _samples(1, 3), 1, Timer()
    )
    assert rollout.rewards.tolist() == [2.0, 4.0]
    assert rollout.data["reward/turn"].tolist() == [1.0, 3.0] and rollout.data["reward/first"].tolist() == [1.0, 1.0]
    assert {k: v.tolist() for k, v in reward_components(rollout.data).items()} == {
        "first": [1.0, 1.0],
        "turn": [1.0, 3.0],
    }
    plain = run_rollout(
        _rollout_cfg(3), ScriptedEngine(), CountingEnvironment(), ByteTokenizer(), _samples(1), 1, Timer()
    )
    assert reward_components(plain.data) == {}


# -- config ----------------------------------------------------------------------------------------------------


def test_gdpo_config_and_its_rules():
    cfg = load_config("examples/grpo_tiny.yaml", ["grpo.advantage_estimator=gdpo", "grpo.gdpo.reward_weights=[1, 2]"])
    assert (cfg.grpo.gdpo.use_leave_one_out_baseline, cfg.grpo.gdpo.normalize_rewards) == (False, True)
    assert cfg.grpo.gdpo.reward_weights == [1.0, 2.0]
    cases = [
        (
            ["grpo.gdpo.normalize_rewards=false"],
            "grpo.gdpo.normalize_rewards: only GDPO reads it, but "
            "grpo.advantage_estimator is leave_one_out; set grpo.advantage_estimator=gdpo or remove it",
        ),
        (
            [
                "grpo.advantage_estimator=gdpo",
                "grpo.reward_shaping.enabled=true",
                "grpo.reward_shaping.stop_properly_penalty_coef=0.5",
            ],
            "grpo.reward_shaping.enabled: is true, but GDPO's",
        ),
        (
            [
                "grpo.advantage_estimator=gdpo",
                "grpo.gdpo.use_leave_one_out_baseline=true",
                "grpo.num_generations_per_prompt=1",
                "grpo.num_prompts_per_step=32",
            ],
            "grpo.num_generations_per_prompt: GDPO with grpo.gdpo.use_leave_one_out_baseline needs at least 2",
        ),
    ]
    for overrides, line in cases:
        with pytest.raises(ConfigError) as info:
            load_config("examples/grpo_tiny.yaml", overrides)
        assert any(p.startswith(line) for p in info.value.problems), info.value.problems


def test_nemo_rls_gdpo_converts():
    from tests.nemo_rl.test_nemo_rl_config import FIXTURES, nemo_config, nemo_problems

    main = FIXTURES / "main" / "grpo_math_1B.yaml"
    conversion = nemo_config(
        main,
        [
            "grpo.adv_estimator.name=gdpo",
            "grpo.adv_estimator.normalize_rewards=true",
            "grpo.adv_estimator.use_leave_one_out_baseline=false",
            "++grpo.adv_estimator.reward_weights=[1.0,0.5]",
        ],
    )
    g = conversion.config.grpo
    assert (
        g.advantage_estimator,
        g.gdpo.use_leave_one_out_baseline,
        g.gdpo.normalize_rewards,
        g.gdpo.reward_weights,
    ) == ("gdpo", False, True, [1.0, 0.5])
    assert "grpo.adv_estimator.minus_baseline (reinforce_plus_plus only)" in "\n".join(conversion.ignored_lines())
    # the base config's adv_estimator interpolates grpo.use_leave_one_out_baseline: true, NeMo-RL's default
    g = nemo_config(main, ["grpo.adv_estimator.name=gdpo"]).config.grpo
    assert (g.gdpo.use_leave_one_out_baseline, g.gdpo.normalize_rewards, g.gdpo.reward_weights) == (True, True, None)
    grpo = nemo_config(main, ["++grpo.adv_estimator.reward_weights=[1.0,0.5]"])
    assert "grpo.adv_estimator.reward_weights (gdpo only)" in "\n".join(grpo.ignored_lines())
    assert grpo.config.grpo.advantage_estimator == "leave_one_out_std"
    (problem,) = nemo_problems(main, "grpo.adv_estimator.name=opd")
    assert problem.startswith("grpo.adv_estimator.name: is 'opd', but rlcore does not support")


# -- a real run ------------------------------------------------------------------------------------------------


def digits_and_brevity(prompts, completions):
    """Two named rewards on the toy task: the share of digits, and being at most 8 characters long."""
    from rlcore.environments.digits import digit_reward

    return {"digits": digit_reward(prompts, completions), "short": [float(len(c) <= 8) for c in completions]}


def test_a_short_gdpo_run_logs_each_component_and_trains(ray_session, tmp_path):
    from rlcore.run.train import train
    from tests.support.runs import ONE_WORKER, short_run_config

    cfg = short_run_config(
        tmp_path,
        2,
        **ONE_WORKER,
        **{
            "grpo.advantage_estimator": "gdpo",
            "grpo.gdpo.reward_weights": "[1.0,0.5]",
            "env.name": "python",
            "env.python_cfg.reward": "tests.algorithms.test_gdpo:digits_and_brevity",
            "grpo.num_prompts_per_step": "4",
            "policy.train_global_batch_size": "16",
            "checkpointing.enabled": "false",
        },
    )
    train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    for row in rows:
        assert 0 <= row["reward/digits_mean"] <= 1 and 0 <= row["reward/short_mean"] <= 1
        assert row["reward_mean"] == pytest.approx(row["reward/digits_mean"] + row["reward/short_mean"], abs=1e-5)
        assert torch.isfinite(torch.tensor([row["loss"], row["grad_norm"]])).all() and row["grad_norm"] > 0
