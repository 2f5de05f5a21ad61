"""Config schemas, YAML loading, overrides, cross-field rules and `rlcore config`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel, ConfigDict, Field
from typer.testing import CliRunner

from rl_dtensor.config import DTensorConfig
from rl_megatron.config import megatron_section
from rlcore.cli.config_cmd import config_app
from rlcore.config import (
    ConfigError,
    GenerationConfig,
    RLCoreConfig,
    SchedulerMilestones,
    SinglePytorchSchedulerConfig,
    apply_overrides,
    config_json_schema,
    dump_config,
    load_config,
    load_config_dict,
    resolve,
    validate_section,
)

REPO = Path(__file__).resolve().parents[2]
MEGATRON = {"dtensor_cfg": {"enabled": False}, "megatron_cfg": {"enabled": True}}
EXAMPLES = sorted(p for p in (REPO / "examples").rglob("*.yaml") if "plugin-template" not in p.parts)


def problems(raw: dict, overrides=()) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config_dict(raw, overrides)
    return info.value.problems


def config_problems(raw: dict) -> list[str]:
    """Problems of loading ``raw`` or, once it loads, of resolving it (the backends' own sections)."""
    with pytest.raises(ConfigError) as info:
        resolve(load_config_dict(raw))
    return info.value.problems


def resolve_problems(raw: dict) -> list[str]:
    """Problems found when a valid config is resolved against the installed backends (layout, batch plan)."""
    cfg = load_config_dict(raw)
    with pytest.raises(ConfigError) as info:
        resolve(cfg)
    return info.value.problems


def write(tmp_path: Path, text: str, name: str = "cfg.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# --- defaults and examples ---------------------------------------------------------------


def test_defaults_validate():
    cfg = load_config()
    assert cfg == load_config_dict({}) == load_config_dict({"cluster": {}, "policy": {}})
    assert cfg.policy.training_backend == "dtensor"
    # values naming another field are derived at load
    assert cfg.policy.tokenizer.name == cfg.policy.model_name
    # and a backend's own section derives them from the policy when it is resolved
    megatron = resolve(load_config_dict({"policy": MEGATRON})).policy.section
    assert megatron.optimizer.lr == cfg.policy.learning_rate
    assert megatron.pipeline_dtype == cfg.policy.precision
    # the layout and the batch plan come from resolving against the installed backends
    plan = resolve(cfg).policy.batch
    assert cfg.world_size == 2 and plan.data_parallel_size == 2
    assert plan.train_mb_tokens == cfg.policy.train_micro_batch_size * cfg.policy.max_total_sequence_length
    assert plan.gradient_accumulation_steps == cfg.policy.train_global_batch_size // 2


def test_configs_are_frozen_values_and_a_copy_derives_again():
    cfg = load_config_dict({"policy": {"dynamic_batching": {"enabled": True}, "generation": {}}})
    with pytest.raises(ValueError, match="frozen"):
        cfg.policy.learning_rate = 1.0
    changed = cfg.policy.model_copy(
        update={"model_name": "tiny-qwen2", "learning_rate": 0.25, "train_micro_batch_size": 2}
    )
    assert changed.tokenizer.name == changed.generation.model_name == "tiny-qwen2"
    assert megatron_section(changed).optimizer.lr == 0.25
    plan = resolve(cfg.model_copy(update={"policy": changed})).policy.batch
    assert plan.train_mb_tokens == 2 * cfg.policy.max_total_sequence_length  # not the stale 1 × seq
    with pytest.raises(ValueError):
        cfg.policy.model_copy(update={"train_micro_batch_size": "2"})  # a copy is validated like a file


def test_empty_file_is_defaults(tmp_path):
    assert load_config(write(tmp_path, "# nothing\n")) == load_config()


def test_examples_found():
    names = {p.name for p in EXAMPLES}
    assert {"dtensor_tiny.yaml", "dtensor_tp2.yaml", "fsdp1_tiny.yaml", "megatron_tiny.yaml", "packing.yaml"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: str(p.relative_to(REPO)))
def test_example_validates(path):
    load_config(path)


def test_example_backends():
    backend = {p.name: load_config(p).policy.training_backend for p in EXAMPLES}
    assert backend["dtensor_tiny.yaml"] == "dtensor"
    assert backend["fsdp1_tiny.yaml"] == "fsdp1"
    assert backend["megatron_tiny.yaml"] == "megatron"
    layout = resolve(load_config(REPO / "examples/megatron_tiny.yaml")).policy.layout
    assert (layout.tp, layout.cp, layout.pp) == (1, 1, 2)
    assert load_config(REPO / "examples/packing.yaml").policy.sequence_packing.enabled


@pytest.mark.parametrize(
    "policy, expected",
    [
        ({}, "dtensor"),
        ({"dtensor_cfg": {"enabled": False}}, "fsdp1"),
        ({"dtensor_cfg": {"enabled": False}, "megatron_cfg": {"enabled": True}}, "megatron"),
        ({"backend": "mybackend"}, "mybackend"),
        ({"dtensor_cfg": {"enabled": False}, "mybackend_cfg": {"enabled": True}}, "mybackend"),  # any backend's section
        ({"megatron_cfg": {"enabled": False}, "mybackend_cfg": {"knob": 1}}, "dtensor"),
    ],
)
def test_training_backend_resolution(policy, expected):
    assert load_config_dict({"policy": policy}).policy.training_backend == expected


def registry_without(*plugins: str):
    """The installed plugins but ``plugins`` (entry-point names): as if those were not installed."""
    from importlib import metadata

    from rlcore.plugins import Registry

    registry = Registry()
    registry.load_entry_points([ep for ep in metadata.entry_points(group="rlcore.plugins") if ep.name not in plugins])
    return registry


@pytest.mark.parametrize(
    "policy, path",
    [
        (MEGATRON, "policy.megatron_cfg.enabled"),
        ({"backend": "megatron"}, "policy.backend"),
        ({"megatron_cfg": {"tensor_model_parallel_size": 2}}, "policy.megatron_cfg"),
    ],
)
def test_a_backend_section_without_its_plugin_says_what_to_install(monkeypatch, policy, path):
    monkeypatch.delenv("RLCORE_PLUGINS", raising=False)
    monkeypatch.delenv("RLCORE_DISABLE_PLUGINS", raising=False)
    registry = registry_without("megatron")
    cfg = load_config_dict({"policy": policy})  # the keys are the same whatever is installed
    with pytest.raises(ConfigError) as info:
        resolve(cfg, registry=registry)
    (line,) = info.value.problems
    assert line.startswith(f"{path}: no backend named 'megatron'") and line.endswith(
        "comes with rlcore's rl-megatron distribution: pip install rl-megatron"
    )
    # NeMo-RL's files carry every backend's section: one switched off needs no plugin ...
    off = load_config_dict({"policy": {"megatron_cfg": {"enabled": False, "tensor_model_parallel_size": 2}}})
    assert resolve(off, registry=registry).policy.spec.name == "dtensor"
    # ... but an installed backend's section is checked by its class even when another backend trains
    with pytest.raises(ConfigError, match=r"^policy\.megatron_cfg\.tensor_model_parallel_size: expected a value > 0"):
        resolve(load_config_dict({"policy": {"megatron_cfg": {"enabled": False, "tensor_model_parallel_size": 0}}}))


@pytest.mark.parametrize(
    "policy, backend", [({}, "fsdp1"), ({"backend": "fsdp1"}, "fsdp1"), ({"backend": "reference"}, "fsdp1")]
)
def test_a_run_without_the_default_engine_falls_back_to_a_training_backend_that_generates(monkeypatch, policy, backend):
    monkeypatch.delenv("RLCORE_PLUGINS", raising=False)
    monkeypatch.delenv("RLCORE_DISABLE_PLUGINS", raising=False)
    raw = {"policy": {**policy, "generation": {}}}
    resolved = resolve(load_config_dict(raw), run=True, registry=registry_without("vllm"))
    assert resolved.policy.spec.name == resolved.generation.spec.name == backend
    assert not resolved.generation.separate
    (notice,) = resolved.notices
    assert notice.startswith("notice: no backend named 'vllm'") and notice.endswith(
        f"; falling back to {backend} for training and generation"
    )
    # with the engine installed, or another engine named, nothing falls back
    assert resolve(load_config_dict(raw), run=True).generation.spec.name == "vllm"
    with pytest.raises(ConfigError, match="no backend named 'sglang'"):
        resolve(
            load_config_dict({"policy": {**policy, "generation": {"backend": "sglang"}}}),
            run=True,
            registry=registry_without("vllm"),
        )


# --- cross-field rules ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw, paths, words",
    [
        (
            {"policy": {"dtensor_cfg": {"tensor_parallel_size": 4}}},
            ["policy.dtensor_cfg.tensor_parallel_size"],
            ["tp 4", "world size 2"],
        ),
        (
            {
                "cluster": {"workers_per_node": 4},
                "policy": {
                    "dtensor_cfg": {"enabled": False},
                    "megatron_cfg": {"enabled": True, "pipeline_model_parallel_size": 3},
                },
            },
            ["policy.megatron_cfg.pipeline_model_parallel_size"],
            ["pp 3", "world size 4"],
        ),
        (
            {
                "policy": {"train_global_batch_size": 6, "train_micro_batch_size": 2},
                "grpo": {"num_prompts_per_step": 3},
            },
            ["policy.train_global_batch_size", "policy.train_micro_batch_size"],
            ["6", "multiple of 4"],
        ),
        (
            {"policy": {"dtensor_cfg": {"context_parallel_size": 2}}},
            ["policy.dtensor_cfg.context_parallel_size", "cluster.use_gpu"],
            ["CUDA", "is 2"],
        ),
        (
            {
                "policy": {
                    "max_grad_norm": 1.0,
                    "dtensor_cfg": {"enabled": False},
                    "megatron_cfg": {"enabled": True, "optimizer": {"clip_grad": 0.5}},
                }
            },
            ["policy.megatron_cfg.optimizer.clip_grad", "policy.max_grad_norm"],
            ["0.5"],
        ),
    ],
)
def test_layout_and_batch_problems_are_found_when_resolving(raw, paths, words):
    """The layout comes from the training backend (rl-dtensor / rl-megatron declare theirs), so these are
    checked when the config is resolved against the installed backends, still before anything starts."""
    load_config_dict(raw)  # valid on its own
    (line,) = resolve_problems(raw)
    for text in paths + words:
        assert text in line, (text, line)


@pytest.mark.parametrize(
    "raw, paths, words",
    [
        (
            {"policy": {"dynamic_batching": {"enabled": True}, "sequence_packing": {"enabled": True}}},
            ["policy.dynamic_batching.enabled", "policy.sequence_packing.enabled"],
            ["mutually exclusive"],
        ),
        (
            {"policy": {"megatron_cfg": {"enabled": True}}},
            ["policy.megatron_cfg.enabled", "policy.dtensor_cfg.enabled"],
            ["enabled=false"],
        ),
        (
            {"policy": {"mybackend_cfg": {"enabled": True}, "megatron_cfg": {"enabled": True}}},
            ["policy.mybackend_cfg.enabled", "policy.megatron_cfg.enabled", "policy.dtensor_cfg.enabled"],
            ["all are true"],
        ),
        (
            {"policy": {"backend": "reference", "activation_checkpointing_enabled": True}},
            ["policy.activation_checkpointing_enabled", "'reference'"],
            ["only fsdp1 reads it"],
        ),
        (
            {"policy": {"generation": {"colocated": False}}},
            ["policy.generation.colocated.resources"],
            ["workers_per_node"],
        ),
        (
            {"loss": {"use_kl_in_reward": True, "reference_policy_kl_penalty": 0.1}},
            ["loss.use_kl_in_reward", "grpo.advantage_estimator"],
            ["reinforce_plus_plus"],
        ),
        (
            {"loss": {"use_kl_in_reward": True}, "grpo": {"advantage_estimator": "reinforce_plus_plus"}},
            ["loss.use_kl_in_reward", "loss.reference_policy_kl_penalty"],
            ["is 0"],
        ),
        (
            {
                "loss": {"use_kl_in_reward": True, "reference_policy_kl_penalty": 0.1, "force_on_policy_ratio": True},
                "grpo": {"advantage_estimator": "reinforce_plus_plus", "num_prompts_per_step": 2},
                "policy": {"train_global_batch_size": 8},
            },
            ["loss.force_on_policy_ratio", "loss.use_kl_in_reward"],
            ["prev-logprob pass"],
        ),
    ],
)
def test_cross_field_rule(raw, paths, words):
    (line,) = problems(raw)
    for text in paths + words:
        assert text in line, (text, line)


ASYNC = {"loss": {"use_importance_sampling_correction": True}}  # async GRPO's own rule satisfied


@pytest.mark.parametrize(
    "raw, paths, words",
    [
        (
            {**ASYNC, "grpo": {"async_grpo": {"enabled": True}, "reward_scaling": {"enabled": True}}},
            ["grpo.reward_scaling.enabled", "grpo.async_grpo.enabled"],
            ["not supported with async GRPO"],
        ),
        (
            {
                **ASYNC,
                "grpo": {
                    "async_grpo": {"enabled": True},
                    "reward_shaping": {"enabled": True, "stop_properly_penalty_coef": 0.5},
                },
            },
            ["grpo.reward_shaping.enabled", "grpo.async_grpo.enabled"],
            ["not supported with async GRPO"],
        ),
        (
            {"grpo": {"batch_multiplier": 2}},
            ["grpo.batch_multiplier", "grpo.use_dynamic_sampling=true"],
            ["is 2.0", "grpo.batch_multiplier=1"],
        ),
        (
            {**ASYNC, "grpo": {"async_grpo": {"enabled": True}, "use_dynamic_sampling": True}},
            ["grpo.use_dynamic_sampling", "grpo.async_grpo.enabled"],
            ["not supported with async GRPO"],
        ),
        (
            {"grpo": {"advantage_clip_low": 1.0, "advantage_clip_high": -1.0}},
            ["grpo.advantage_clip_low", "grpo.advantage_clip_high"],
            ["1.0 > -1.0"],
        ),
        ({"grpo": {"advantage_clip_low": 0.5}}, ["grpo.advantage_clip_low"], ["0.5 > 0", "<= 0"]),
        (
            {"grpo": {"advantage_clip_high": -0.5, "advantage_clip_low": -2.0}},
            ["grpo.advantage_clip_high"],
            ["-0.5 < 0", ">= 0"],
        ),
        (
            {"grpo": {"reward_scaling": {"enabled": True, "source_min": 1.0, "source_max": 1.0}}},
            ["grpo.reward_scaling.source_max", "grpo.reward_scaling.source_min"],
            ["source_max > source_min"],
        ),
        (
            {"grpo": {"reward_shaping": {"enabled": True, "max_response_length": 512}}},
            ["grpo.reward_shaping.overlong_buffer_length", "grpo.reward_shaping.overlong_buffer_penalty"],
            ["are null", "stop_properly_penalty_coef"],
        ),
        (
            {
                "grpo": {
                    "reward_shaping": {
                        "enabled": True,
                        "overlong_buffer_length": 256,
                        "overlong_buffer_penalty": 1.0,
                        "max_response_length": 128,
                    }
                }
            },
            ["grpo.reward_shaping.overlong_buffer_length", "grpo.reward_shaping.max_response_length"],
            ["is 256", "128"],
        ),
    ],
    ids=[
        "scaling_async",
        "shaping_async",
        "multiplier_without_ds",
        "ds_not_yet",
        "clip_crossed",
        "clip_low_positive",
        "clip_high_negative",
        "scaling_empty_range",
        "shaping_missing",
        "shaping_buffer_too_long",
    ],
)
def test_grpo_reward_option_rules(raw, paths, words):
    (line,) = problems(raw)
    for text in paths + words:
        assert text in line, (text, line)


def test_grpo_reward_options_that_are_fine():
    g = load_config_dict(
        {
            "grpo": {
                "dynamic_sampling_max_gen_batches": 3,
                "advantage_clip_low": -5.0,
                "advantage_clip_high": 5,
                "overlong_filtering": True,
                "reward_scaling": {
                    "enabled": True,
                    "source_min": 0,
                    "source_max": 1,
                    "target_min": -1,
                    "target_max": 1,
                },
                "reward_shaping": {
                    "enabled": True,
                    "overlong_buffer_length": 128,
                    "overlong_buffer_penalty": 1,
                    "max_response_length": 128,
                },
            }
        }
    ).grpo
    assert (g.advantage_clip_high, g.reward_scaling.target_min) == (5.0, -1.0)
    # the truncation penalty needs none of the DAPO keys, and ignores them when they are there
    load_config_dict({"grpo": {"reward_shaping": {"enabled": True, "stop_properly_penalty_coef": 0.0}}})
    load_config_dict(
        {
            "grpo": {
                "reward_shaping": {
                    "enabled": True,
                    "stop_properly_penalty_coef": 1.0,
                    "overlong_buffer_length": 999,
                    "max_response_length": 1,
                }
            }
        }
    )
    # switched off, a section's values are not checked against each other
    load_config_dict(
        {"grpo": {"reward_scaling": {"source_min": 1, "source_max": 0}, "reward_shaping": {"max_response_length": 8}}}
    )
    g = load_config_dict({"grpo": {}}).grpo
    assert (
        g.use_dynamic_sampling,
        g.dynamic_sampling_max_gen_batches,
        g.batch_multiplier,
        g.overlong_filtering,
        g.advantage_clip_low,
        g.advantage_clip_high,
        g.reward_shaping.enabled,
        g.reward_scaling.enabled,
    ) == (False, 10, 1.0, False, None, None, False, False)  # NeMo-RL's defaults


@pytest.mark.parametrize(
    "grpo, line",
    [
        ({"batch_multiplier": 0.5}, "grpo.batch_multiplier: expected a value >= 1, got 0.5"),
        ({"dynamic_sampling_max_gen_batches": 0}, "grpo.dynamic_sampling_max_gen_batches: expected a value > 0"),
        (
            {"reward_shaping": {"stop_properly_penalty_coef": 1.5}},
            "grpo.reward_shaping.stop_properly_penalty_coef: expected a value <= 1, got 1.5",
        ),
        (
            {"reward_shaping": {"overlong_buffer_penalty": -1.0}},
            "grpo.reward_shaping.overlong_buffer_penalty: expected a value >= 0",
        ),
        (
            {"reward_shaping": {"overlong_buffer_length": 0}},
            "grpo.reward_shaping.overlong_buffer_length: expected a value > 0",
        ),
    ],
)
def test_grpo_reward_option_values(grpo, line):
    (problem,) = problems({"grpo": grpo})
    assert problem.startswith(line), problem


def test_context_parallel_allowed_with_gpu():
    resolved = resolve(
        load_config_dict({"cluster": {"use_gpu": True}, "policy": {"dtensor_cfg": {"context_parallel_size": 2}}})
    )
    assert resolved.policy.layout.cp == 2 and resolved.policy.data_parallel_size == 1


def test_parallel_sizes_of_unselected_backend_ignored():
    # megatron_cfg is disabled, so its pp=3 does not constrain the world size
    resolve(load_config_dict({"policy": {"megatron_cfg": {"pipeline_model_parallel_size": 3}}}))


def test_several_rule_violations_all_reported():
    found = problems(
        {
            "policy": {
                "dynamic_batching": {"enabled": True},
                "sequence_packing": {"enabled": True},
                "megatron_cfg": {"enabled": True},
                "fsdp_offload_enabled": True,
            }
        }
    )
    assert len(found) == 3, found


# --- schema errors -----------------------------------------------------------------------


def test_unknown_key_hint():
    assert problems({"policy": {"train_micro_batchsize": 2}}) == [
        "policy.train_micro_batchsize: unknown key; did you mean 'train_micro_batch_size'?"
    ]


def test_unknown_key_without_close_match_has_no_hint():
    assert problems({"policy": {"zzzqqq": 1}}) == ["policy.zzzqqq: unknown key"]


def test_unknown_key_in_nested_and_list_sections():
    found = problems({"clustr": {}, "policy": {"scheduler": [{"name": "x", "kwarg": {}}]}})
    assert "clustr: unknown key; did you mean 'cluster'?" in found
    assert "policy.scheduler[0].kwarg: unknown key; did you mean 'kwargs'?" in found
    # a backend's own section is checked by its config class when the config is resolved
    found = config_problems(
        {"policy": {"dtensor_cfg": {"tensor_paralel_size": 2}, "megatron_cfg": {"pipeline_model_paralel_size": 2}}}
    )
    assert found == [
        "policy.megatron_cfg.pipeline_model_paralel_size: unknown key; did you mean 'pipeline_model_parallel_size'?",
        "policy.dtensor_cfg.tensor_paralel_size: unknown key; did you mean 'tensor_parallel_size'?",
    ]


def test_bad_type_names_path_and_value():
    assert problems({"policy": {"train_micro_batch_size": "abc"}}) == [
        "policy.train_micro_batch_size: expected an integer, got 'abc'"
    ]


@pytest.mark.parametrize(
    "policy, line",
    [
        ({"precision": "fp8"}, "policy.precision: expected one of 'float32', 'bfloat16' or 'float16', got 'fp8'"),
        ({"max_grad_norm": "x"}, "policy.max_grad_norm: expected a number, got 'x'"),
        ({"max_grad_norm": -1}, "policy.max_grad_norm: expected a value > 0, got -1"),
        ({"dtensor_cfg": 3}, "policy.dtensor_cfg: expected a mapping (key: value), got 3"),
        ({"vllm_cfg": [1]}, "policy.vllm_cfg: expected a mapping (key: value), got [1]"),
        ({"scheduler": [{"kwargs": {}}]}, "policy.scheduler[0].name: required key is missing"),
        ({"train_micro_batch_size": True}, "policy.train_micro_batch_size: expected an integer, got true"),
        ({"train_micro_batch_size": 2.5}, "policy.train_micro_batch_size: expected an integer, got 2.5"),
        (
            {"generation": {"colocated": "maybe"}},
            "policy.generation.colocated: expected a mapping (key: value), got 'maybe'",
        ),
    ],
)
def test_bad_values(policy, line):
    assert problems({"policy": policy}) == [line]


def test_all_problems_of_a_file_reported(tmp_path):
    path = write(
        tmp_path,
        "cluster:\n  num_nodes: zero\npolicy:\n  train_micro_batchsize: 2\n"
        "  precision: fp8\n  max_grad_norm: x\n  dtensor_cfg:\n    enabled: maybe\n",
    )
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert len(info.value.problems) == 4
    assert str(info.value) == "\n".join(info.value.problems)
    assert info.value.source == str(path)
    assert "Traceback" not in str(info.value) and "pydantic" not in str(info.value)


@pytest.mark.parametrize(
    "section, line",
    [
        ({"tensor_parallel_size": 0}, "policy.dtensor_cfg.tensor_parallel_size: expected a value > 0, got 0"),
        ({"enabled": "maybe"}, "policy.dtensor_cfg.enabled: expected true or false, got 'maybe'"),
    ],
)
def test_bad_values_of_a_backend_section(section, line):
    assert config_problems({"policy": {"dtensor_cfg": section}}) == [line]


def test_colocated_bool_shorthand():
    assert GenerationConfig(colocated=False).colocated.enabled is False
    cfg = load_config_dict({}, ["policy.generation.colocated={enabled: false, resources: {}}"])
    assert cfg.policy.generation.colocated.resources.workers_per_node == 1
    assert load_config_dict({"policy": {"generation": {}}}).policy.generation.colocated.enabled is True


def test_max_grad_norm_null_and_int():
    assert load_config_dict({"policy": {"max_grad_norm": None}}).policy.max_grad_norm is None
    assert load_config_dict({"policy": {"max_grad_norm": 2}}).policy.max_grad_norm == 2


# --- YAML ----------------------------------------------------------------------------------


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    path = write(tmp_path, "policy:\n  model_name: x\n  bad: [1, 2\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    (line,) = info.value.problems
    assert line.startswith(f"{path}:") and "invalid YAML" in line
    assert line.split(":")[1].isdigit()


def test_yaml_duplicate_key_is_an_error(tmp_path):
    path = write(tmp_path, "policy:\n  model_name: a\n  model_name: b\n")
    with pytest.raises(ConfigError, match="duplicate key 'model_name'"):
        load_config(path)


def test_yaml_exponent_floats(tmp_path):
    cfg = load_config(write(tmp_path, "policy:\n  learning_rate: 1e-5\n  optimizer:\n    kwargs: {eps: 1e-8}\n"))
    assert cfg.policy.learning_rate == 1e-5
    assert cfg.policy.optimizer.kwargs["eps"] == 1e-8


def test_missing_file_and_non_mapping(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "absent.yaml")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(write(tmp_path, "- 1\n- 2\n"))


# --- overrides -----------------------------------------------------------------------------


def test_override_values_are_yaml():
    out = apply_overrides(
        {"policy": {"x": 1}},
        [
            "policy.train_micro_batch_size=2",
            "policy.max_grad_norm=null",
            "policy.generation.stop_token_ids=[1,2]",
            "a.b.c=text",
        ],
    )
    assert out["policy"] == {
        "x": 1,
        "train_micro_batch_size": 2,
        "max_grad_norm": None,
        "generation": {"stop_token_ids": [1, 2]},
    }
    assert out["a"] == {"b": {"c": "text"}}


def test_override_does_not_mutate_input():
    raw = {"policy": {"dtensor_cfg": {"enabled": True}}}
    apply_overrides(raw, ["policy.dtensor_cfg.enabled=false"])
    assert raw == {"policy": {"dtensor_cfg": {"enabled": True}}}


def test_overrides_through_loader(tmp_path):
    path = write(tmp_path, "policy:\n  train_micro_batch_size: 1\n  generation: null\n")
    cfg = load_config(
        path,
        [
            "policy.train_micro_batch_size=2",
            "policy.max_grad_norm=null",
            "policy.generation.stop_token_ids=[1,2]",
            "cluster.workers_per_node=4",
        ],
    )
    assert cfg.policy.train_micro_batch_size == 2
    assert cfg.policy.max_grad_norm is None
    assert cfg.policy.generation.stop_token_ids == [1, 2]
    assert cfg.world_size == 4


def test_override_list_index():
    raw = {"policy": {"scheduler": [{"name": "a"}]}}
    cfg = load_config_dict(raw, ["policy.scheduler[0].name=b", "policy.scheduler.0.kwargs.gamma=0.5"])
    assert cfg.policy.scheduler[0] == SinglePytorchSchedulerConfig(name="b", kwargs={"gamma": 0.5})


@pytest.mark.parametrize("bad", ["policy.train_micro_batch_size", "=3", "a..b=1", "a.=1", "x=[1,"])
def test_malformed_override_named(bad):
    (line,) = problems({}, [bad])
    assert line.startswith(f"override '{bad}':")


def test_override_bad_value_reports_path():
    assert problems({}, ["policy.train_micro_batch_size=abc"]) == [
        "policy.train_micro_batch_size: expected an integer, got 'abc'"
    ]


def test_override_through_scalar_is_an_error():
    (line,) = problems({"policy": {"model_name": "m"}}, ["policy.model_name.x=1"])
    assert "not a mapping" in line


# --- backend sections ----------------------------------------------------------------------


def test_cfg_sections_collected_and_dumped_under_their_names():
    cfg = load_config_dict(
        {
            "policy": {
                "mybackend_cfg": {"knob": 3},
                "empty_cfg": None,
                "generation": {"vllm_cfg": {"gpu_memory_utilization": 0.5}},
            }
        }
    )
    assert cfg.policy.backend_sections == {"mybackend_cfg": {"knob": 3}, "empty_cfg": {}}
    assert cfg.policy.generation.backend_sections == {"vllm_cfg": {"gpu_memory_utilization": 0.5}}
    dumped = yaml.safe_load(dump_config(cfg))
    assert dumped["policy"]["mybackend_cfg"] == {"knob": 3}
    assert dumped["policy"]["generation"]["vllm_cfg"] == {"gpu_memory_utilization": 0.5}
    assert "backend_sections" not in dumped["policy"]


def test_non_cfg_unknown_key_rejected_next_to_sections():
    (line,) = problems({"policy": {"mybackend_cfg": {}, "mybackend": {}}})
    assert line.startswith("policy.mybackend: unknown key")


class _SectionModel(BaseModel):
    model_config = ConfigDict(extra="forbid")
    knob: int = Field(1, description="A knob.")


def test_validate_section():
    model, found = validate_section(_SectionModel, {"knob": 3}, "policy.my_cfg")
    assert model == _SectionModel(knob=3) and found == []
    model, found = validate_section(_SectionModel, {"knob": "x", "knb": 1}, "policy.my_cfg")
    assert model is None
    assert found == [
        "policy.my_cfg.knob: expected an integer, got 'x'",
        "policy.my_cfg.knb: unknown key; did you mean 'knob'?",
    ]
    assert validate_section(_SectionModel, None, "p.my_cfg") == (_SectionModel(), [])
    assert validate_section(_SectionModel, 5, "p.my_cfg") == (
        None,
        ["p.my_cfg: expected a mapping (key: value), got 5"],
    )
    assert validate_section(DTensorConfig, {"enabled": False}, "policy.dtensor_cfg")[0].enabled is False


# --- scheduler -------------------------------------------------------------------------------


def test_scheduler_milestones_in_list():
    cfg = load_config_dict(
        {
            "policy": {
                "scheduler": [
                    {"name": "torch.optim.lr_scheduler.LinearLR", "kwargs": {"start_factor": 0.1, "total_iters": 5}},
                    {"name": "torch.optim.lr_scheduler.ConstantLR", "kwargs": {"factor": 1.0}},
                    {"name": "milestones", "milestones": [5]},
                ]
            }
        }
    )
    first, second, marks = cfg.policy.scheduler
    assert isinstance(first, SinglePytorchSchedulerConfig) and isinstance(second, SinglePytorchSchedulerConfig)
    assert marks == SchedulerMilestones(name="milestones", milestones=[5])


def test_scheduler_milestone_count_checked():
    (line,) = problems(
        {"policy": {"scheduler": [{"name": "a"}, {"name": "b"}, {"name": "milestones", "milestones": [1, 2]}]}}
    )
    assert line.startswith("policy.scheduler[2].milestones:") and "one milestone fewer" in line


# --- dump / schema -----------------------------------------------------------------------


@pytest.mark.parametrize("fmt, parse", [("yaml", yaml.safe_load), ("json", json.loads)])
def test_dump_load_round_trip(fmt, parse):
    cfg = load_config(
        REPO / "examples/dtensor_tiny.yaml",
        ["policy.vllm_cfg.x=1", "policy.scheduler=[{name: a}]", "policy.max_grad_norm=2"],
    )
    again = load_config_dict(parse(dump_config(cfg, fmt)))
    assert again == cfg
    assert dump_config(again, fmt) == dump_config(cfg, fmt)


def test_json_schema():
    schema = config_json_schema()
    json.dumps(schema)
    assert "policy" in schema["properties"] and "cluster" in schema["properties"]
    policy = schema["$defs"]["PolicyConfig"]
    assert policy["additionalProperties"] is False
    assert "^.+_cfg$" in policy["patternProperties"]
    assert "backend_sections" not in policy.get("required", [])
    assert all("description" in f for f in policy["properties"].values())


def test_json_schema_accepts_examples():
    jsonschema = pytest.importorskip("jsonschema")
    from rlcore.config.yaml_io import read_config_file

    schema = config_json_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    for path in EXAMPLES:
        jsonschema.validate(read_config_file(path), schema)


def test_every_field_documented():
    seen: set[type] = set()

    def visit(model: type[BaseModel]) -> None:
        if model in seen:
            return
        seen.add(model)
        assert model.model_config.get("extra") == "forbid", model
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name}"
            for arg in _types_in(field.annotation):
                if isinstance(arg, type) and issubclass(arg, BaseModel):
                    visit(arg)

    visit(RLCoreConfig)
    assert len(seen) >= 16


def _types_in(tp):
    import typing

    yield tp
    for arg in typing.get_args(tp):
        yield from _types_in(arg)


def test_import_is_light():
    code = (
        "import sys, rlcore.config, rlcore.cli.config_cmd; "
        "print([m for m in ('torch', 'ray', 'vllm', 'megatron') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# --- CLI -----------------------------------------------------------------------------------


@pytest.fixture
def runner():
    return CliRunner()


def test_cli_validate_ok(runner):
    path = REPO / "examples/dtensor_tiny.yaml"
    result = runner.invoke(config_app, ["validate", str(path)])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == f"OK: {path} (training backend: dtensor, world size 2, data parallel 2)"


def test_cli_validate_with_overrides(runner):
    path = REPO / "examples/dtensor_tiny.yaml"
    result = runner.invoke(
        config_app,
        ["validate", str(path), "-o", "cluster.workers_per_node=4", "--override", "policy.dtensor_cfg.enabled=false"],
    )
    assert result.exit_code == 0, result.output
    assert "(training backend: fsdp1, world size 4, data parallel 4)" in result.stdout


def test_cli_validate_fail(runner, tmp_path):
    path = write(tmp_path, "policy:\n  train_micro_batchsize: 2\n  precision: fp8\n")
    result = runner.invoke(config_app, ["validate", str(path)])
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert sorted(lines) == sorted(
        [
            "policy.train_micro_batchsize: unknown key; did you mean 'train_micro_batch_size'?",
            "policy.precision: expected one of 'float32', 'bfloat16' or 'float16', got 'fp8'",
        ]
    )
    assert "Traceback" not in result.output and result.stdout == ""


def test_cli_validate_reports_backend_section_and_layout_problems(tmp_path):
    text = "policy:\n  dtenzor_cfg: {}\n  dtensor_cfg: {tensor_parallel_size: 4}\n"
    result = CliRunner().invoke(config_app, ["validate", str(write(tmp_path, text))])
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [
        "policy.dtenzor_cfg: no installed backend named 'dtenzor'; did you mean 'dtensor_cfg'?",
        "policy.dtensor_cfg.tensor_parallel_size: tp 4 does not divide the world size 2 (cluster.num_nodes × "
        "cluster.workers_per_node); choose sizes whose product divides 2, or a cluster of a multiple of 4 ranks",
    ]


def test_cli_validate_missing_file(runner, tmp_path):
    result = runner.invoke(config_app, ["validate", str(tmp_path / "nope.yaml")])
    assert result.exit_code == 1 and "no such file" in result.stderr


def test_cli_show_json(runner):
    path = REPO / "examples/megatron_tiny.yaml"
    result = runner.invoke(config_app, ["show", str(path), "--format", "json", "-o", "policy.mine_cfg.k=1"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["policy"]["megatron_cfg"]["pipeline_model_parallel_size"] == 2
    assert data["policy"]["mine_cfg"] == {"k": 1}
    assert load_config_dict(data) == load_config(path, ["policy.mine_cfg.k=1"])


def test_cli_show_yaml(runner):
    result = runner.invoke(config_app, ["show", str(REPO / "examples/packing.yaml")])
    assert result.exit_code == 0, result.output
    assert yaml.safe_load(result.stdout)["policy"]["sequence_packing"]["enabled"] is True


def test_cli_schema(runner):
    result = runner.invoke(config_app, ["schema"])
    assert result.exit_code == 0
    assert "policy" in json.loads(result.stdout)["properties"]


def test_torch_optimizer_settings_are_refused_for_megatron_which_never_reads_them(tmp_path):
    from rlcore.config import dump_config

    ok = load_config("examples/grpo_megatron.yaml")  # no policy.optimizer: AdamW at learning_rate, unused
    again = tmp_path / "shown.yaml"
    again.write_text(dump_config(ok))  # what `rlcore config show` writes loads back
    assert load_config(again) == ok
    resolve(ok, run=True)
    for override, path in (
        ("policy.optimizer.name=torch.optim.SGD", "policy.optimizer"),
        ("policy.optimizer.kwargs.lr=0.5", "policy.optimizer"),
        ("policy.scheduler=[{name: torch.optim.lr_scheduler.ConstantLR}]", "policy.scheduler"),
    ):
        with pytest.raises(ConfigError) as info:  # megatron's own config check, when the config is resolved
            resolve(load_config("examples/grpo_megatron.yaml", [override]), run=True)
        assert [p.split(":")[0] for p in info.value.problems] == [path], info.value.problems
        assert "megatron_cfg" in info.value.problems[0]
    resolve(load_config("examples/grpo_tiny.yaml", ["policy.optimizer.name=torch.optim.SGD"]))  # dtensor reads it
