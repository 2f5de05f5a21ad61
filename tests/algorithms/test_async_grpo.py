"""Asynchronous GRPO: the config rules, the fallback, and short real runs whose rollouts' weight versions
(tagged by the engine per sample) obey the age rule, before and after a resume."""

from __future__ import annotations

import json

import pytest

from rlcore.config import ConfigError, load_config, resolve
from rlcore.plugins import get_registry

EXAMPLE = "examples/grpo_async_tiny.yaml"


def test_async_needs_its_own_engine_and_says_when_it_trains_uncorrected():
    with pytest.raises(ConfigError) as err:
        load_config(EXAMPLE, ["policy.generation.colocated=true"])
    assert (
        "grpo.async_grpo.enabled: generation can run ahead of training only on its own resources, but "
        "policy.generation.colocated.enabled is true"
    ) in str(err.value)
    assert load_config(EXAMPLE).grpo.async_grpo.max_trajectory_age_steps == 1
    # Without importance weights (NeMo-RL's single-controller loop trains so) the run is allowed, with a notice.
    uncorrected = load_config(EXAMPLE, ["loss.use_importance_sampling_correction=false"])
    if vllm_missing():
        return
    resolved = resolve(uncorrected, run=True)
    assert resolved.async_generation is True
    assert any("trained as if on-policy" in n and "up to 1 step(s) older" in n for n in resolved.notices)
    assert not any("as if on-policy" in n for n in resolve(load_config(EXAMPLE), run=True).notices)


def test_a_backend_that_generates_itself_falls_back_to_synchronous():
    cfg = load_config(EXAMPLE, ["policy.generation.backend=fsdp1", "policy.backend=fsdp1"])
    resolved = resolve(cfg, run=True)  # decided once, with a notice, before anything starts
    assert resolved.async_generation is False
    assert resolved.notices == (
        "notice: grpo.async_grpo.enabled, but the 'fsdp1' training backend generates with "
        "its own weights; training synchronously",
    )
    assert resolve(load_config(EXAMPLE), run=True).async_generation is (not vllm_missing())


def vllm_missing() -> bool:
    return {r.name: r.status for r in get_registry().records}.get("vllm") != "ok"


def async_config(tmp_path, steps: int):
    return load_config(
        EXAMPLE,
        [
            "policy.backend=reference",
            f"grpo.max_num_steps={steps}",
            f"logger.output_dir={tmp_path}",
            "logger.progress_bar=false",
            "checkpointing.save_every_n_steps=2",
        ],
    )


@pytest.mark.skipif(vllm_missing(), reason="needs rl-vllm")
def test_rollouts_are_never_older_than_the_limit_and_resume_keeps_the_rule(ray_session, tmp_path):
    from rlcore.run.train import train

    def rows() -> list[dict]:
        return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]

    train(async_config(tmp_path, 4))
    first = rows()
    # From the engine's tags: rollout 0 on the weights it trains, every later one a step older (it was
    # generated while the previous step trained), never more.
    assert [r["async/age_max"] for r in first] == [0, 1, 1, 1]
    assert [r["async/age_1_fraction"] for r in first] == [0.0, 1.0, 1.0, 1.0]
    assert [r["weight_version"] for r in first] == [0, 0, 1, 2]  # the verified versions the ages come from
    assert abs(first[0]["token_mult_prob_error"] - 1) < 1e-3 and abs(first[0]["sampling_importance_ratio"] - 1) < 1e-3
    assert all(r["token_mult_prob_error"] > 1 + 1e-4 for r in first[1:]), "one-step-old rollouts match the trainer"
    for key in (
        "time/generation_wait_s",
        "time/generation_idle_s",
        "time/refit_s",
        "time/train_s",
        "sampling_importance_ratio",
        "clip_fraction",
        "async/regenerated_rollouts",
    ):
        assert key in first[1], key
    assert all(r["async/regenerated_rollouts"] == 0 for r in first)

    train(async_config(tmp_path, 6), resume=True)  # from the checkpoint after step 3; in-flight work is gone
    resumed = rows()
    assert [r["step"] for r in resumed] == list(range(6))
    assert [r["async/age_max"] for r in resumed[4:]] == [0, 1], "the resumed run starts the schedule again"
    assert [r["weight_version"] for r in resumed[4:]] == [4, 4]  # versions go on from the resumed step
