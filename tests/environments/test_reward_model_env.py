"""The ``reward_model`` environment on real Ray workers of its own: its rewards are a float64 single-process Hugging
Face forward of the same checkpoint (a sequence-classification reward model loaded as ``model_name``, and a
token-classification one loaded from ``checkpoint_path`` over a causal LM), its workers sit in a placement group of
their own, and closing it leaves none of them behind.

One environment per checkpoint kind, started once for the module (a few seconds each on CPU).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"}],
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue, like the sky on a clear day."},
    ],
    [{"role": "user", "content": "Say nothing."}, {"role": "assistant", "content": ""}],
]
TOL = 1e-4


def reward_model_dir(root: Path, kind: str, seed: int, preset: str = "tiny-qwen2") -> str:
    """A tiny reward model of a tiny preset with random weights (its head included) and its tokenizer."""
    from transformers import (
        AutoConfig,
        AutoModelForSequenceClassification,
        AutoModelForTokenClassification,
        AutoTokenizer,
    )

    from rlcore.models import resolve_model

    base = resolve_model(preset)
    config = AutoConfig.from_pretrained(base)
    config.num_labels, config.pad_token_id = 1, 0
    cls = AutoModelForSequenceClassification if kind == "sequence" else AutoModelForTokenClassification
    torch.manual_seed(seed)
    model = cls.from_config(config)
    with torch.no_grad():  # a head far from zero, so that a wrong position or bias shows
        model.score.weight.normal_(0.0, 0.5)
        if getattr(model.score, "bias", None) is not None:
            model.score.bias.fill_(0.25)
    out = root / kind
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)
    return str(out)


def reference_scores(path: str, kind: str, rows: list[list[int]]) -> list[float]:
    """Each row alone (no padding) through Hugging Face in float64: the score at its last token."""
    from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification

    cls = AutoModelForSequenceClassification if kind == "sequence" else AutoModelForTokenClassification
    model = cls.from_pretrained(path, dtype=torch.float64).eval()
    with torch.no_grad():
        outs = [model(input_ids=torch.tensor([ids])).logits for ids in rows]
    return [float(out[0, 0] if kind == "sequence" else out[0, -1, 0]) for out in outs]


def template_ids(path: str, log: list[dict[str, str]]) -> list[int]:
    """The tokenizer's own chat template over the whole conversation (it writes BOS and each message's EOS)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    return tokenizer(tokenizer.apply_chat_template(log, tokenize=False), add_special_tokens=False).input_ids


def passthrough_ids(path: str, log: list[dict[str, str]]) -> list[int]:
    """The passthrough template (the contents, concatenated) with BOS and EOS around them."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    text = "".join(m["content"] for m in log)
    return [tokenizer.bos_token_id, *tokenizer(text, add_special_tokens=False).input_ids, tokenizer.eos_token_id]


def section(**settings: Any) -> Any:
    from rlcore.algorithms.rm.environment_config import RewardModelConfig
    from rlcore.config.loader import validate_section

    validated, problems = validate_section(RewardModelConfig, settings, "env.reward_model_cfg")
    assert validated is not None, problems
    return validated


@pytest.mark.parametrize(
    ("settings", "line"),
    [
        ({"policy": {"backend": "fsdp1"}}, "env.reward_model_cfg.policy.backend: model_head='value': the 'fsdp1'"),
        (
            {"policy": {"dtensor_cfg": {"tensor_parallel_size": 2}}},
            "env.reward_model_cfg.policy.dtensor_cfg.tensor_parallel_size: tp 2 does not divide the world size 1 "
            "(env.reward_model_cfg.resources.num_nodes",
        ),
        ({"policy": {"learning_rate": 0.1}}, "env.reward_model_cfg.policy: learning_rate is not one of the reward"),
        ({"policy": {"sequence_packing": {"enabled": True}}}, "env.reward_model_cfg.policy: sequence_packing.enabled"),
        ({"batch_size": 0}, "env.reward_model_cfg.batch_size: expected a value > 0"),
        ({"num_workers": 1}, "env.num_workers: is 1; the reward model runs in Ray workers of its own"),
    ],
)
def test_a_section_that_cannot_run_is_refused_before_anything_starts(settings, line) -> None:
    """Resolution (no Ray, no model load) names the path and the fix."""
    from rlcore.config import ConfigError, load_config_dict, resolve

    env: dict[str, Any] = {"name": "reward_model", "reward_model_cfg": {"model_name": "tiny-qwen2"}}
    if "num_workers" in settings:
        env["num_workers"] = settings["num_workers"]
    else:
        env["reward_model_cfg"].update(settings)
    config = load_config_dict({"policy": {"model_name": "tiny-qwen2", "generation": {"backend": "vllm"}}, "env": env})
    with pytest.raises(ConfigError) as caught:
        resolve(config, run=True)
    assert [p for p in caught.value.problems if p.startswith(line)], caught.value.problems


def test_a_missing_checkpoint_or_tokenizer_fails_before_any_worker_is_reserved(tmp_path: Path, monkeypatch) -> None:
    from rlcore.algorithms.rm import environment as reward_model
    from rlcore.config import ConfigError

    def no_cluster(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a cluster was reserved for a reward model that cannot load")

    monkeypatch.setattr("rlcore.distributed.RayVirtualCluster", no_cluster)
    missing = tmp_path / "missing"
    settings = section(model_name="tiny-qwen2", checkpoint_path=str(missing), resources={"use_gpu": False})
    with pytest.raises(ConfigError) as caught:
        reward_model.RewardModelEnvironment(settings)
    [line] = caught.value.problems
    assert line.startswith(f"env.reward_model_cfg.checkpoint_path: {missing}"), line

    # an rlcore checkpoint's weights/ without a tokenizer (a Llama: transformers builds no tokenizer from its config
    # alone): the line names the one beside it
    step = tmp_path / "step_000009"
    weights = Path(reward_model_dir(step, "token", seed=3, preset="tiny-llama"))
    (step / "tokenizer").mkdir()
    for file in weights.iterdir():  # the tokenizer's files go beside weights/, as a checkpoint keeps them
        if not file.name.startswith(("config", "model", "generation")):
            file.rename(step / "tokenizer" / file.name)
    with pytest.raises(ConfigError) as caught:
        reward_model.RewardModelEnvironment(section(model_name=str(weights), resources={"use_gpu": False}))
    [line] = caught.value.problems
    assert line.startswith(f"env.reward_model_cfg.policy.tokenizer.name: no tokenizer loads from {weights}"), line
    assert line.endswith(f"set it to {step / 'tokenizer'} (the reward model's own)"), line


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("reward-models")
    return {kind: reward_model_dir(root, kind, seed) for kind, seed in (("sequence", 1), ("token", 2))}


@pytest.fixture(scope="module")
def environments(ray_session: None, models: dict[str, str]) -> Any:
    """``sequence``: the sequence-classification model as model_name, passthrough template, 2 ranks (the odd batch
    is padded for them), one conversation per forward pass. ``token``: tiny-qwen2 (a causal LM) as model_name with
    the token-classification checkpoint as checkpoint_path, the tokenizer's own template, 1 rank."""
    from rlcore.algorithms.rm.environment import RewardModelEnvironment

    started: dict[str, Any] = {}
    try:
        started["sequence"] = RewardModelEnvironment(
            section(model_name=models["sequence"], batch_size=1, resources={"workers_per_node": 2})
        )
        started["token"] = RewardModelEnvironment(
            section(
                model_name="tiny-qwen2",
                checkpoint_path=models["token"],
                batch_size=2,
                policy={"tokenizer": {"name": models["token"], "chat_template": "default"}},
            )
        )
        yield started
    finally:
        for env in started.values():
            env.close()


@pytest.mark.parametrize(("kind", "ids_of"), [("sequence", passthrough_ids), ("token", template_ids)])
def test_rewards_are_the_float64_hf_score_at_the_last_token(environments, models, kind, ids_of) -> None:
    env = environments[kind]
    rows = [ids_of(models[kind], log) for log in CONVERSATIONS]
    assert [env.encode(log) for log in CONVERSATIONS] == rows
    metadata = [{"ground_truth": None, "i": i} for i in range(len(CONVERSATIONS))]
    result = env.step(CONVERSATIONS, metadata)
    expected = reference_scores(models[kind], kind, rows)
    assert max(expected) - min(expected) > 1e-2, expected  # different conversations, different scores
    assert result.rewards == pytest.approx(expected, abs=TOL), (result.rewards, expected)
    assert result.reward_components == {"reward_model": result.rewards}
    assert result.errors == [None] * 3 and result.terminateds == [True] * 3 and result.metadata == metadata


def test_a_conversation_longer_than_max_model_len_is_a_failed_sample(environments, models) -> None:
    env = environments["token"]
    long = [{"role": "user", "content": "x" * env.config.max_model_len}, {"role": "assistant", "content": "y"}]
    result = env.step([long, CONVERSATIONS[0]], [{}, {}])
    assert result.rewards[0] == 0.0 and "longer than env.reward_model_cfg.max_model_len (4096)" in result.errors[0]
    expected = reference_scores(models["token"], "token", [template_ids(models["token"], CONVERSATIONS[0])])
    assert result.errors[1] is None and result.rewards[1] == pytest.approx(expected[0], abs=TOL)


def test_its_workers_are_its_own_and_closing_leaves_none(environments, make_cluster) -> None:
    """Beside a run's cluster (one bundle), the environment's workers are in a placement group of their own with
    its resources' bundles; close stops them and removes the group, and nothing of the run's. (Last: it closes the
    module's 2-rank environment.)"""
    from ray.util import placement_group_table

    env = environments["sequence"]
    run_pg = make_cluster(1).get_placement_group()
    pg = env.cluster.get_placement_group()
    assert pg.id != run_pg.id and env.policy.worker_group.cluster is env.cluster
    assert placement_group_table(pg)["state"] == "CREATED" and len(pg.bundle_specs) == 2
    pids = env.policy.worker_group.worker_pids()
    assert len(pids) == 2 and all(alive(pid, wait_s=0) for pid in pids)
    env.close()
    assert placement_group_table(pg)["state"] == "REMOVED"
    assert placement_group_table(run_pg)["state"] == "CREATED"
    assert not [pid for pid in pids if alive(pid)], pids


def alive(pid: int, wait_s: float = 10.0) -> bool:
    """Whether ``pid`` is still running after up to ``wait_s`` seconds (a stopped worker takes a moment to exit)."""
    import time

    deadline = time.monotonic() + wait_s
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        if time.monotonic() > deadline:
            return True
        time.sleep(0.1)
