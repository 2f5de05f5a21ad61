"""A third party adds an algorithm without touching rlcore: ``tests/fixtures/algorithm-rloo`` (REINFORCE with a
leave-one-out baseline, its own distribution with an ``rlcore.plugins`` entry point and an ``rloo:`` section) is
pip-installed into a private directory; its loss is checked against a float64 hand computation, its section is
validated by its config class, and it trains the tiny model for two steps through ``rlcore run``."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rlcore.config import ConfigError, load_config_dict

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "fixtures" / "algorithm-rloo"


@pytest.fixture(scope="module")
def rloo_site(tmp_path_factory) -> Path:
    """The fixture distribution installed (no dependencies: rlcore and torch come from this environment) into a
    private directory, which is put on the path only of the processes that use it."""
    root = tmp_path_factory.mktemp("rloo")
    source = root / FIXTURE.name
    shutil.copytree(FIXTURE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    site = root / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(site),
            str(source),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    return site


@pytest.fixture
def rloo_registered(rloo_site, monkeypatch):
    """This process's registry with the installed entry points plus the fixture's plugin."""
    from rlcore.plugins import Registry
    from rlcore.testing.pytest_plugin import isolated_registry

    monkeypatch.syspath_prepend(str(rloo_site))
    monkeypatch.setattr("rlcore.config.schemas._INSTALLED", [])  # what this test sees installed stays its own
    import rlcore_rloo.plugin

    registry = Registry()
    registry.load_entry_points()
    registry.register_plugin(rlcore_rloo.plugin, name="rloo", distribution="rlcore-algorithm-rloo")
    with isolated_registry(registry):
        yield registry


def test_leave_one_out_advantages_and_loss_match_a_hand_computation(rloo_registered):
    import torch
    from rlcore_rloo.loss import RLOOLoss, leave_one_out_advantages

    rewards = torch.tensor([1.0, 0.0, 0.5, 0.25, 0.25, 1.0], dtype=torch.float64)
    k = 3
    expected = []
    for i, r in enumerate(rewards.tolist()):
        group = rewards.tolist()[i // k * k : (i // k + 1) * k]
        others = [x for j, x in enumerate(group) if j != i % k]
        expected.append(r - sum(others) / len(others))
    advantages = leave_one_out_advantages(rewards, k)
    assert advantages.tolist() == pytest.approx(expected, abs=1e-15)
    assert expected[0] == pytest.approx(1.0 - 0.25) and expected[5] == pytest.approx(1.0 - 0.25)

    generator = torch.Generator().manual_seed(0)
    logprobs = -torch.rand(6, 5, generator=generator, dtype=torch.float64)
    logprobs.requires_grad_(True)
    token_mask = torch.tensor(
        [[0, 0, 1, 1, 1], [0, 1, 1, 0, 0], [0, 0, 0, 1, 0], [1, 1, 1, 1, 1], [0, 0, 1, 1, 0], [0, 1, 0, 1, 1]],
        dtype=torch.float64,
    )
    sample_mask = torch.tensor([1, 1, 1, 1, 0, 1], dtype=torch.float64)
    data = {"token_mask": token_mask, "sample_mask": sample_mask, "advantages": advantages[:, None] * token_mask}
    total, count = 0.0, 0
    for b in range(6):
        for t in range(1, 5):  # position 0 has no logprob
            if token_mask[b, t] and sample_mask[b]:
                total += -expected[b] * float(logprobs[b, t])
                count += 1
    loss, metrics = RLOOLoss()(logprobs, data, torch.tensor(5.0), torch.tensor(float(count)))
    assert float(loss) == pytest.approx(total / count, abs=1e-12)
    assert metrics["num_valid_tokens"] == count
    loss.backward()
    assert float(logprobs.grad[3, 0]) == 0.0 and float(logprobs.grad[4, 2]) == 0.0  # position 0, masked sample
    assert float(logprobs.grad[0, 2]) == pytest.approx(-expected[0] / count, abs=1e-15)


def test_its_section_is_validated_by_its_config_class(rloo_registered):
    cfg = load_config_dict({"rloo": {"num_prompts_per_step": 4}})
    assert cfg.algorithm == "rloo" and cfg.rloo.num_prompts_per_step == 4 and cfg.grpo is None
    with pytest.raises(ConfigError, match=r"rloo.num_generations_per_prompt: is 1; the leave-one-out baseline"):
        load_config_dict({"rloo": {"num_generations_per_prompt": 1}})
    with pytest.raises(
        ConfigError,
        match=r"rloo.num_promts_per_step: unknown key; did you mean "
        r"'num_prompts_per_step'\?",
    ):
        load_config_dict({"rloo": {"num_promts_per_step": 4}})
    with pytest.raises(ConfigError, match=r"grpo, rloo: a config trains one algorithm"):
        load_config_dict({"rloo": {}, "grpo": {}})
    with pytest.raises(ConfigError, match=r"loss: the config trains rloo, so nothing reads the policy-gradient"):
        load_config_dict({"rloo": {}, "loss": {"ratio_clip_min": 0.1}})


def test_without_the_plugin_its_section_is_an_unknown_key():
    with pytest.raises(ConfigError, match=r"rloo: unknown key"):
        load_config_dict({"rloo": {}})


def test_two_algorithms_claiming_the_default_are_refused_not_guessed(monkeypatch):
    """A config without an algorithm section trains the default; when two installed plugins claim it, rlcore says so
    instead of picking one by name."""
    from rlcore.plugins import AlgorithmSpec, Registry, hookimpl
    from rlcore.testing.pytest_plugin import isolated_registry

    class Rival:
        @staticmethod
        @hookimpl
        def rlcore_register_algorithms(register):
            register(
                AlgorithmSpec(
                    name="rival",
                    config_class="rlcore.algorithms.grpo.config:GRPOConfig",
                    algorithm_class="rlcore.algorithms.grpo.loop:GRPO",
                    default=True,
                )
            )

    monkeypatch.setattr("rlcore.config.schemas._INSTALLED", [])
    registry = Registry()
    registry.load_entry_points()
    assert load_config_dict({}).algorithm == "grpo"
    registry.register_plugin(Rival, name="rival")
    with isolated_registry(registry):
        with pytest.raises(ConfigError, match=r"grpo, rival each say they are the default"):
            load_config_dict({}).algorithm
        assert load_config_dict({"grpo": {}}).algorithm == "grpo"  # a section says which


RUN_CONFIG = """
cluster: {num_nodes: 1, workers_per_node: 1, use_gpu: false}
policy:
  backend: fsdp1
  model_name: tiny-llama
  train_global_batch_size: 8
  train_micro_batch_size: 4
  logprob_batch_size: 8
  max_total_sequence_length: 64
  generation: {backend: fsdp1, max_new_tokens: 8, temperature: 1.0}
rloo: {num_prompts_per_step: 4, num_generations_per_prompt: 2, max_num_steps: 2}
env: {name: digits}
logger: {output_dir: OUT, progress_bar: false, tensorboard: false}
checkpointing: {enabled: false}
"""


def run_with_plugin(site: Path, config_text: str, tmp_path: Path) -> tuple[dict, list[dict]]:
    """``rlcore run`` of ``config_text`` (``OUT``: its output directory) with the plugin installed at ``site``
    (every installed plugin enabled): its summary and its metrics rows. Fails the test when the run fails."""
    config = tmp_path / "config.yaml"
    config.write_text(config_text.replace("OUT", str(tmp_path / "run")))
    env = {k: v for k, v in os.environ.items() if k not in ("RLCORE_PLUGINS", "RLCORE_DISABLE_PLUGINS")}
    env["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [env.get("PYTHONPATH")])])
    out = subprocess.run(
        [sys.executable, "-m", "rlcore", "run", str(config)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    return json.loads(out.stdout.strip().splitlines()[-1]), rows


def test_it_trains_the_tiny_model_through_rlcore_run(rloo_site, tmp_path):
    summary, rows = run_with_plugin(rloo_site, RUN_CONFIG, tmp_path)
    assert summary["steps"] == 2 and summary["first_reward_mean"] is not None
    assert [r["step"] for r in rows] == [0, 1]
    # the algorithm's own rows (a step whose groups all score alike has zero advantages, so no gradient)
    assert all(
        0 <= r["reward_mean"] <= 1
        and r["advantage_abs_mean"] >= 0
        and math.isfinite(r["loss"])
        and math.isfinite(r["grad_norm"])
        for r in rows
    )


RFT_FIXTURE = REPO / "tests" / "fixtures" / "algorithm-rft"
RFT_CONFIG = """
cluster: {num_nodes: 1, workers_per_node: 1, use_gpu: false}
policy:
  backend: fsdp1
  model_name: tiny-llama
  train_global_batch_size: 16
  train_micro_batch_size: 4
  logprob_batch_size: 16
  max_total_sequence_length: 64
  generation: {backend: fsdp1, max_new_tokens: 8, temperature: 1.0}
rft: {num_prompts_per_step: 4, num_generations_per_prompt: 4, max_num_steps: 2, reward_threshold: 0.0}
env: {name: digits}
logger: {output_dir: OUT, progress_bar: false, tensorboard: false}
checkpointing: {enabled: true, save_every_n_steps: 2}
"""


@pytest.fixture(scope="module")
def rft_site(tmp_path_factory) -> Path:
    """``tests/fixtures/algorithm-rft`` installed like the RLOO fixture (see :func:`rloo_site`)."""
    root = tmp_path_factory.mktemp("rft")
    source = root / RFT_FIXTURE.name
    shutil.copytree(RFT_FIXTURE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    site = root / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(site)]
        + [str(source)],
        check=True,
        capture_output=True,
        text=True,
    )
    return site


def test_rft_s_config_class_derives_from_nothing_of_rlcore_s(rft_site, monkeypatch):
    """Its section is a plain pydantic model: it validates, and a config without the rollout loop's settings
    (val_period, max_rollout_turns, ...) loads without any core rule reading them."""
    from rlcore.plugins import Registry
    from rlcore.testing.pytest_plugin import isolated_registry

    monkeypatch.syspath_prepend(str(rft_site))
    monkeypatch.setattr("rlcore.config.schemas._INSTALLED", [])
    import rlcore_rft.plugin
    from rlcore_rft.config import RFTConfig

    assert not [c for c in RFTConfig.__mro__ if c.__module__.startswith("rlcore.")]
    registry = Registry()
    registry.load_entry_points()
    registry.register_plugin(rlcore_rft.plugin, name="rft", distribution="rlcore-algorithm-rft")
    with isolated_registry(registry):
        cfg = load_config_dict({"rft": {"num_prompts_per_step": 2, "reward_threshold": 0.25}})
        assert cfg.algorithm == "rft" and cfg.rft.reward_threshold == 0.25 and cfg.rft.num_prompts_per_step == 2
        with pytest.raises(ConfigError, match=r"rft.reward_treshold"):
            load_config_dict({"rft": {"reward_treshold": 0.25}})


def test_rft_trains_two_steps_on_the_toolkit_keeping_only_rewarded_completions(rft_site, tmp_path):
    """Two steps through ``rlcore run``: each step's kept and rejected completions split the 16 sampled at the
    threshold, the loss counts the kept completions' generated tokens only (no padding row, no rejected one), and
    the weights the run saved differ from the initial model's."""
    from safetensors.torch import load_file

    from rlcore.models.builtin import resolve_model

    summary, rows = run_with_plugin(rft_site, RFT_CONFIG, tmp_path)
    assert summary["steps"] == 2
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["kept"] + r["rejected"] == 16 and 0 <= r["reward_mean"] <= 1
        if r["kept"]:
            assert r["kept_reward_min"] > 0.0 and math.isfinite(r["loss"]) and r["grad_norm"] > 0
            assert r["num_valid_tokens"] == r["kept_generated_tokens"] > 0  # kept rows only
        if r["rejected"]:
            assert r["rejected_reward_max"] <= 0.0
    assert any(r["kept"] for r in rows), rows  # 16 completions of 8 tokens: some hold a digit
    trained = load_file(str(Path(summary["final_weights"]) / "model.safetensors"))
    initial = load_file(str(Path(resolve_model("tiny-llama")) / "model.safetensors"))
    shared = sorted(set(trained) & set(initial))
    assert shared and any(not trained[k].equal(initial[k].to(trained[k].dtype)) for k in shared)
