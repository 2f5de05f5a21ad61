"""rlcore.training.lora against PEFT (single process), and the config rules of policy.lora."""

from __future__ import annotations

import pytest
import torch

from rlcore.config import load_config_dict
from rlcore.config.policy import LoRAConfig
from rlcore.training import lora


@pytest.fixture(scope="module")
def adapted(tiny_model_dir):
    """The tiny Llama with rank-4 adapters on q/v (B made non-zero) and the same model through PEFT."""
    from peft import LoraConfig, get_peft_model

    from rlcore.testing.oracle import load_hf_model

    cfg = LoRAConfig(
        enabled=True, dim=4, alpha=8, match_all_linear=False, target_modules=["q_proj", "v_proj", "lm_head"]
    )
    ours = load_hf_model(tiny_model_dir)
    targets = lora.apply_lora(ours, cfg)
    with torch.no_grad():
        for layer in lora.lora_layers(ours).values():
            layer.lora_B.weight.normal_(0, 0.1)
    theirs = get_peft_model(load_hf_model(tiny_model_dir), LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    tensors = {n: t for n, t in ours.state_dict().items() if lora.is_adapter_name(n)}
    for name, p in theirs.named_parameters():
        if ".lora_" in name:
            with torch.no_grad():
                p.copy_(tensors[name.removeprefix("base_model.model.").replace(".default.", ".")])
    return cfg, targets, ours, theirs


def test_only_adapters_train_and_merged_weights_equal_peft_merge(adapted):
    cfg, targets, ours, theirs = adapted
    assert all(lora.is_adapter_name(n) for n, p in ours.named_parameters() if p.requires_grad)
    assert targets == [f"model.layers.{i}.self_attn.{m}" for i in range(2) for m in ("q_proj", "v_proj")] + ["lm_head"]
    merged = dict(lora.merge_stream(ours.state_dict().items(), cfg.alpha / cfg.dim))
    meta = lora.merged_metadata({n: (tuple(t.shape), "float32") for n, t in ours.state_dict().items()})
    assert list(merged) == list(meta), "merge_stream's order must be merged_metadata's (the refit plan)"
    reference = {n: t.detach().clone() for n, t in theirs.merge_and_unload().state_dict().items()}
    assert set(merged) == set(reference)
    worst = max(float((merged[n] - reference[n]).abs().max()) for n in merged)
    assert worst <= 1e-6, worst


def test_changed_layers_take_whole_fused_groups(adapted):
    cfg, targets, ours, _ = adapted
    changed = lora.changed_layers(targets)
    qkv = {f"model.layers.{i}.self_attn.{m}" for i in range(2) for m in ("q_proj", "k_proj", "v_proj")}
    assert changed == qkv | {"lm_head"}
    part = dict(lora.merge_stream(ours.state_dict().items(), cfg.alpha / cfg.dim, changed))
    meta = lora.merged_metadata({n: (tuple(t.shape), "float32") for n, t in ours.state_dict().items()}, changed)
    assert list(part) == list(meta)
    assert {n.rsplit(".", 2)[-2] for n in part} == {"q_proj", "k_proj", "v_proj", "lm_head"}


def test_the_lm_head_is_adapted_only_when_named_and_untied(tiny_model_dir):
    from rlcore.testing.oracle import load_hf_model

    model = load_hf_model(tiny_model_dir)
    everything = lora.select_targets(model, LoRAConfig(enabled=True))
    assert "lm_head" not in everything and len(everything) == 14
    with_head = lora.select_targets(model, LoRAConfig(enabled=True, target_modules=["lm_head"]))
    assert with_head == everything + ["lm_head"]
    model.config.tie_word_embeddings = True
    with pytest.raises(ValueError, match="policy.lora.target_modules: names the LM head .* ties it"):
        lora.select_targets(model, LoRAConfig(enabled=True, target_modules=["lm_head"]))


def test_adapters_disabled_is_the_base_model(adapted, tiny_model_dir):
    from rlcore.testing.oracle import load_hf_model

    _, _, ours, _ = adapted
    ids = torch.randint(3, 200, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = load_hf_model(tiny_model_dir)(input_ids=ids).logits
        with lora.adapters_disabled(ours):
            off = ours(input_ids=ids).logits
        on = ours(input_ids=ids).logits
    assert torch.equal(off, base) and float((on - base).abs().max()) > 1e-3


@pytest.mark.parametrize(
    "policy, line",
    [
        (
            {"megatron_cfg": {"enabled": True}, "dtensor_cfg": {"enabled": False}, "lora": {"enabled": True}},
            "policy.lora.enabled: the 'megatron' training backend does not train LoRA adapters",
        ),
    ],
)
def test_lora_needs_a_backend_that_declares_it(policy, line):
    from rlcore.config import ConfigError, resolve

    with pytest.raises(ConfigError) as caught:
        resolve(load_config_dict({"policy": policy}))
    assert len(caught.value.problems) == 1 and caught.value.problems[0].startswith(line), caught.value.problems
    assert resolve(load_config_dict({"policy": {"lora": {"enabled": True}}})).policy.spec.name == "dtensor"


def test_adapter_refit_needs_an_engine_that_declares_it():
    from rlcore.config.backends import lora_problems
    from rlcore.plugins import BackendSpec, hookimpl
    from rlcore.plugins.registry import Registry

    class Plugin:
        @hookimpl
        def rlcore_register_backends(self, register):
            register(
                BackendSpec(
                    name="trainer",
                    kind="training",
                    worker_class="collections:Counter",
                    capabilities={"train", "lora"},
                    plugin_api_version=2,
                )
            )
            register(BackendSpec(name="plain", kind="generation", worker_class="collections:Counter"))
            register(
                BackendSpec(
                    name="lora-engine",
                    kind="generation",
                    worker_class="collections:Counter",
                    capabilities={"generate", "lora_adapter"},
                    plugin_api_version=2,
                )
            )

    registry = Registry()
    registry.register_plugin(Plugin(), name="p")

    def problems(engine: str) -> list[str]:
        policy = load_config_dict(
            {
                "policy": {
                    "backend": "trainer",
                    "lora": {"enabled": True, "refit": "adapter"},
                    "generation": {"backend": engine},
                }
            }
        ).policy
        return lora_problems(policy, registry.resolve("trainer"), registry.resolve(engine), registry)

    (line,) = problems("plain")
    assert line.startswith(
        "policy.lora.refit: 'adapter' needs a generation backend that applies LoRA adapters "
        "itself ('lora_adapter' capability), and 'plain' does not declare it"
    ), line
    assert problems("lora-engine") == []


def test_an_adapter_checkpoint_is_checked_against_policy_lora_before_any_worker_starts(
    adapted, tiny_model_dir, tmp_path
):
    from rlcore.config.policy import PolicyConfig
    from rlcore.preflight import check_policy_sources

    cfg, targets, ours, _ = adapted
    adapters = {n: t for n, t in ours.state_dict().items() if lora.is_adapter_name(n)}
    lora.save_lora_checkpoint(adapters, lora.peft_adapter_config(cfg, targets, tiny_model_dir), tmp_path / "ckpt")

    def problems(**lora_cfg) -> list[str]:
        policy = PolicyConfig(model_name=tiny_model_dir, lora=lora_cfg)
        return check_policy_sources(policy, tmp_path / "ckpt")

    assert problems(enabled=True, dim=4, alpha=8, target_modules=["q_proj"]) == []
    assert problems(enabled=False) == [
        f"weights_path: {tmp_path / 'ckpt'} is a LoRA adapter checkpoint, but "
        "policy.lora.enabled is false; enable policy.lora with the settings it was "
        "trained with, or pass a full model directory"
    ]
    (line,) = problems(enabled=True, dim=8, alpha=8)
    assert line.startswith(
        "weights_path: the adapter was trained with {'dim': 4, 'alpha': 8.0}, but policy.lora "
        "has {'dim': 8, 'alpha': 8.0}"
    ), line
    (tmp_path / "ckpt" / "adapter_model.safetensors").unlink()
    (line,) = problems(enabled=True, dim=4, alpha=8)
    assert "has adapter_config.json but no adapter_model.safetensors" in line, line
