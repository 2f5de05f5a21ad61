"""The prev-logprob pass of a GRPO step: skipped exactly when redundant (issue 14).

When a rollout is trained in one optimizer step, every micro-batch's forward runs on the parameters
that sampled it, so ``prev_logprobs`` from a separate pass equal the current logprobs. Here: the
decision (``loss.force_on_policy_ratio`` null / true / false), the numbers of one training step with
and without the pass, and the step metrics of the GRPO loop.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlcore.algorithms.grpo.loss import ClippedPGLossFn
from rlcore.algorithms.grpo.prev_logprobs import skips_prev_logprob_pass
from rlcore.config import ConfigError, load_config, resolve

REPO = Path(__file__).resolve().parents[2]
TINY = "examples/grpo_tiny.yaml"  # rollout 8 prompts x 4 = 32 = policy.train_global_batch_size


# -- the decision ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, skips",
    [
        ([], True),  # default null, one optimizer step per rollout
        (["policy.train_global_batch_size=16"], False),  # the rollout takes 2 optimizer steps
        (["loss.force_on_policy_ratio=false"], False),
        (["loss.force_on_policy_ratio=true"], True),
    ],
)
def test_the_pass_is_skipped_exactly_when_the_rollout_is_one_optimizer_step(overrides, skips):
    cfg = load_config(TINY, overrides)
    assert skips_prev_logprob_pass(cfg) is skips
    resolved = resolve(cfg, run=True).config.loss  # decided once, when a run's config is resolved
    assert resolved.force_on_policy_ratio is skips
    assert ClippedPGLossFn(resolved).cfg.force_on_policy_ratio is skips


def test_a_model_with_dropout_keeps_the_pass(tmp_path):
    """Training forwards run in train mode, the logprob pass in eval mode: with dropout they differ."""
    import json

    for dropout, skips in ((0.1, False), (0.0, True)):
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "attention_dropout": dropout}))
        assert skips_prev_logprob_pass(load_config(TINY, [f"policy.model_name={tmp_path}"])) is skips
    assert skips_prev_logprob_pass(
        load_config(TINY, [f"policy.model_name={tmp_path}", "loss.force_on_policy_ratio=true"])
    )  # forced: user's call


def test_resolving_leaves_the_users_config_alone():
    cfg = load_config(TINY)
    assert cfg.loss.force_on_policy_ratio is None  # the default: automatic
    assert resolve(cfg, run=True).config.loss.force_on_policy_ratio is True
    assert cfg.loss.force_on_policy_ratio is None


def test_forcing_it_over_two_optimizer_steps_is_the_clear_error():
    with pytest.raises(ConfigError) as info:
        load_config(TINY, ["loss.force_on_policy_ratio=true", "policy.train_global_batch_size=16"])
    (line,) = [p for p in info.value.problems if p.startswith("loss.force_on_policy_ratio")]
    assert "batch 32 != policy.train_global_batch_size 16" in line and "null (automatic" in line


@pytest.mark.parametrize("nemo_value, expected", [(False, None), (True, True)])
def test_nemo_rl_false_is_automatic(nemo_value, expected):
    """NeMo-RL's false asks for the pass, which is redundant exactly where rlcore skips it."""
    from rlcore.nemo_rl import load_nemo_rl_config

    path = REPO / "tests" / "fixtures" / "nemo_rl" / "v0.7.0" / "grpo_math_1B.yaml"
    cfg = load_nemo_rl_config(
        path,
        [
            f"++data.train.data_path={path.parent.parent / 'math.jsonl'}",
            f"loss_fn.force_on_policy_ratio={str(nemo_value).lower()}",
        ],
    ).config
    assert cfg.loss.force_on_policy_ratio is expected
    assert skips_prev_logprob_pass(cfg) is True  # 32 prompts x 16 = 512 = train_global_batch_size


# -- the numbers: one optimizer step with and without the pass -------------------------------------------


def _policy_config(model_dir: str, gbs: int):
    from rlcore.config import load_config_dict

    raw = {
        "cluster": {"workers_per_node": 2},
        "policy": {
            "backend": "reference",
            "model_name": model_dir,
            "train_global_batch_size": gbs,
            "train_micro_batch_size": 2,
            "logprob_batch_size": 4,
            "max_grad_norm": 1.0,
            "optimizer": {"name": "torch.optim.SGD", "kwargs": {"lr": 0.5}},
        },
    }
    return load_config_dict(raw).policy


def _rollout(policy, tokenizer, n: int):
    """A batch like a GRPO rollout: advantages on the trained tokens, engine logprobs a little off."""
    from rlcore.data import BatchedDataDict
    from rlcore.testing.models import make_batch

    data = BatchedDataDict(make_batch(tokenizer, n, 6, 14, seed=1))
    rng = torch.Generator().manual_seed(2)
    mask = data["token_mask"]
    data["advantages"] = torch.randn(n, 1, generator=rng) * mask
    engine_noise = 0.01 * torch.randn(mask.shape, generator=rng)
    data["generation_logprobs"] = (policy.get_logprobs(data)["logprobs"] + engine_noise) * mask
    return data


def _train_once(policy, data, force: bool, gbs: int, out: Path | None = None):
    """One ``policy.train`` call, with ``prev_logprobs`` from a separate pass unless ``force``."""
    from rlcore.algorithms.grpo.loss_config import ClippedPGLossConfig

    batch = data.copy()
    if not force:
        batch["prev_logprobs"] = policy.get_logprobs(batch)["logprobs"]
    result = policy.train(batch, ClippedPGLossFn(ClippedPGLossConfig(force_on_policy_ratio=force)), gbs=gbs)
    if out is not None:
        policy.save_checkpoint(str(out))
    return result


def _parameters(path: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return {name: value.detach() for name, value in model.named_parameters()}


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def test_one_step_without_the_pass_trains_like_one_step_with_it(ray_session, tiny_model_dir, tiny_tokenizer, tmp_path):
    """Two fresh 2-rank policies, same data, 4 micro-batches of gradient accumulation in one optimizer
    step: same loss, grad norm and updated parameters (1e-6 relative). Then, as a control, a rollout
    over two optimizer steps, where the pass is not redundant: the second step's losses differ."""
    from rlcore.distributed import RayVirtualCluster
    from rlcore.policy import Policy

    n = 8
    results, checkpoints, second = {}, {}, {}
    for force in (False, True):
        cluster = RayVirtualCluster([2])
        policy = Policy(cluster, _policy_config(tiny_model_dir, gbs=n), tiny_tokenizer)
        try:
            data = _rollout(policy, tiny_tokenizer, n)
            checkpoints[force] = tmp_path / f"force_{force}"
            results[force] = _train_once(policy, data, force, n, checkpoints[force])
            second[force] = _train_once(policy, data, force, n // 2)
        finally:
            policy.shutdown()
            cluster.shutdown()

    with_pass, skipped = results[False], results[True]
    assert with_pass["loss"].shape == skipped["loss"].shape == (1,)
    assert _relative_error(skipped["loss"], with_pass["loss"]) < 1e-6
    assert _relative_error(skipped["grad_norm"], with_pass["grad_norm"]) < 1e-6
    assert with_pass["grad_norm"][0] > 0
    # The engine-vs-policy check is computed in both: generation logprobs vs the unchanged parameters'.
    error_pass = with_pass["metrics"]["token_mult_prob_error"]
    error_skip = skipped["metrics"]["token_mult_prob_error"]
    assert error_pass > 1.001 and abs(error_skip - error_pass) < 1e-6 * error_pass
    before = _parameters(Path(tiny_model_dir))
    after_pass, after_skip = _parameters(checkpoints[False]), _parameters(checkpoints[True])
    moved = 0
    for name, value in after_pass.items():
        assert _relative_error(after_skip[name], value) < 1e-6, name
        moved += not torch.equal(value, before[name])
    assert moved > 0

    # Control: over two optimizer steps the second step's prev_logprobs are stale, ratios are not 1.
    assert second[False]["loss"].shape == (2,)
    assert abs(float(second[True]["loss"][1] - second[False]["loss"][1])) > 1e-4


# -- the GRPO loop ---------------------------------------------------------------------------------------


def test_grpo_steps_report_which_path_they_took(ray_session, tmp_path):
    """One run, two steps: the default (one optimizer step per rollout) skips the pass, false runs it."""
    from rlcore.algorithms.grpo.loop import grpo_step
    from rlcore.run.build import build_run
    from tests.support.runs import ONE_WORKER, short_run_config

    resolved = resolve(short_run_config(tmp_path, 2, **ONE_WORKER, **{"checkpointing.enabled": "false"}), run=True)
    cfg = resolved.config  # force_on_policy_ratio resolved: true here (one optimizer step per rollout)
    with_pass = cfg.model_copy(update={"loss": cfg.loss.model_copy(update={"force_on_policy_ratio": False})})
    run = build_run(resolved)
    try:
        rows = [grpo_step(run, step, ClippedPGLossFn(c.loss)) for step, c in enumerate([cfg, with_pass])]
    finally:
        run.shutdown()
    assert [r["prev_logprobs_pass"] for r in rows] == [0.0, 1.0]
    assert all(abs(r["token_mult_prob_error"] - 1.0) < 1e-3 for r in rows), rows  # generator == trainer
    assert rows[0]["time/logprob_s"] < rows[1]["time/logprob_s"]
