"""``--resume`` restores PPO's critic with the policy: a run of ``ppo_tiny`` saves the critic under ``value/`` of
its step checkpoint, and a critic started from that step (as a resumed run starts it) gives the saved critic's
values, not those of a critic freshly built from the language model."""

from __future__ import annotations

from pathlib import Path

STEPS = 2


def test_a_resumed_run_s_critic_is_the_saved_one(ray_session: None, tmp_path: Path) -> None:
    import torch
    from transformers import AutoConfig

    from rlcore.config import load_config, resolve
    from rlcore.data import BatchedDataDict
    from rlcore.distributed import RayVirtualCluster
    from rlcore.run.build import start_value_model
    from rlcore.run.checkpoints import latest_step
    from rlcore.run.prompts import load_tokenizer
    from rlcore.run.train import train
    from rlcore.testing.conformance.value_model import hf_values, load_value_checkpoint
    from rlcore.testing.models import make_batch
    from rlcore.training.value_head import load_value_model, value_model_config

    overrides = [f"ppo.max_num_steps={STEPS}", f"logger.output_dir={tmp_path}", "logger.progress_bar=false"]
    resolved = resolve(load_config("examples/ppo_tiny.yaml", overrides), run=True)
    train(resolved)
    step, step_dir = latest_step(tmp_path / "checkpoints")
    assert step == STEPS - 1 and (step_dir / "value" / "optimizer").is_dir()

    tokenizer = load_tokenizer(resolved.config)
    batch = BatchedDataDict(make_batch(tokenizer, 4, 5, 16, seed=7))
    cluster = RayVirtualCluster.from_config(resolved.config.cluster)
    critic = start_value_model(resolved.value_model, cluster, tokenizer, step_dir)
    try:
        values = critic.get_values(batch)["values"].double()
    finally:
        critic.shutdown()
        cluster.shutdown()
    with torch.no_grad():
        saved = hf_values(load_value_checkpoint(step_dir / "value" / "weights"), batch)
        model_dir = resolved.value_model.config.model_name
        fresh = hf_values(load_value_model(model_dir, value_model_config(AutoConfig.from_pretrained(model_dir))), batch)
    torch.testing.assert_close(values, saved, rtol=1e-4, atol=1e-4)
    assert (values - fresh.double()).abs().max() > 1e-2  # the critic trained: a fresh one would be told apart
