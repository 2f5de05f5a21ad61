"""policy.hf_config_overrides (rlcore.training.hf_config): applied to the config the model is built from, refused
in one line for a key the config lacks or one that changes a parameter's shape. Single process, tiny models."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def llama_dir() -> str:
    from rlcore.models import resolve_model

    return resolve_model("tiny-llama")


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def test_an_override_builds_the_model_hf_builds_with_that_config(llama_dir):
    """The loaded model computes what an HF model built from the overridden config computes, and not what the
    checkpoint's own config gives (the override changes the numbers)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlcore.training.hf_config import pretrained_model

    overrides = {"rms_norm_eps": 0.05, "rope_parameters": {"rope_type": "default", "rope_theta": 37.0}}
    got = pretrained_model(llama_dir, overrides, dtype=torch.float32)
    assert got.config.rms_norm_eps == 0.05 and got.config.rope_parameters["rope_theta"] == 37.0
    config = AutoConfig.from_pretrained(llama_dir)
    config.rms_norm_eps, config.rope_parameters = 0.05, dict(overrides["rope_parameters"])
    expected = AutoModelForCausalLM.from_pretrained(llama_dir, config=config, dtype=torch.float32)
    plain = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    ids = torch.randint(3, 250, (2, 12), generator=torch.Generator().manual_seed(0))
    assert torch.equal(_logits(got, ids), _logits(expected, ids))
    assert float((_logits(got, ids) - _logits(plain, ids)).abs().max()) > 1e-3


def test_no_overrides_is_the_checkpoint_s_config(llama_dir):
    from transformers import AutoConfig

    from rlcore.training.hf_config import load_config

    assert load_config(llama_dir, {}).to_dict() == AutoConfig.from_pretrained(llama_dir).to_dict()


@pytest.mark.parametrize(
    ("overrides", "line"),
    [
        ({"capacity_factor": 1.25}, r"^policy\.hf_config_overrides\.capacity_factor: LlamaConfig .* has no setting"),
        ({"intermediate_size": 64}, r"^policy\.hf_config_overrides: setting intermediate_size changes the model's "),
        ({"vocab_size": 512, "rms_norm_eps": 0.1}, r"^policy\.hf_config_overrides: setting rms_norm_eps, vocab_size"),
    ],
)
def test_overrides_that_would_change_nothing_or_break_the_weights_are_refused(llama_dir, overrides, line):
    from rlcore.training.hf_config import load_config

    with pytest.raises(ValueError, match=line) as info:
        load_config(llama_dir, overrides)
    assert "\n" not in str(info.value)


def test_a_separate_engine_that_takes_no_overrides_is_refused_before_anything_starts():
    """A generation backend whose driver class declares no ``hf_config_overrides`` would serve the checkpoint's
    model while the trainer trains the overridden one: refused at resolution, naming the key; one declaring it
    (rl-vllm's) passes, and so does a run with no overrides."""
    from rlcore.config.backends import hf_config_overrides_problems
    from rlcore.config.loader import load_config_dict
    from rlcore.plugins import BackendSpec, hookimpl
    from rlcore.plugins.registry import Registry

    class Plugin:
        @hookimpl
        def rlcore_register_backends(self, register):
            register(BackendSpec(name="trainer", kind="training", worker_class="collections:Counter"))
            register(
                BackendSpec(
                    name="plain",
                    kind="generation",
                    worker_class="collections:Counter",
                    driver_class="fractions:Fraction",
                )
            )
            register(
                BackendSpec(
                    name="engine",
                    kind="generation",
                    worker_class="collections:Counter",
                    driver_class="rl_vllm.generation:VllmGeneration",
                )
            )

    registry = Registry()
    registry.register_plugin(Plugin(), name="p")

    def problems(engine: str, overrides: dict) -> list[str]:
        policy = load_config_dict(
            {"policy": {"backend": "trainer", "hf_config_overrides": overrides, "generation": {"backend": engine}}}
        ).policy
        return hf_config_overrides_problems(policy, registry.resolve(engine), registry.resolve("trainer"))

    (line,) = problems("plain", {"rms_norm_eps": 0.05})
    assert line.startswith("policy.hf_config_overrides: the generation backend 'plain' does not take it"), line
    assert problems("engine", {"rms_norm_eps": 0.05}) == []
    assert problems("plain", {}) == []
