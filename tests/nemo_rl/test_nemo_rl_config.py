"""Reading NeMo-RL configs: NeMo-RL's own example GRPO configs (fixtures, four releases), the loader
(defaults, interpolation, Hydra overrides), the mapping rule, the CLI, and one real run."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from rlcore.cli.app import app
from rlcore.config import ConfigError, load_config, resolve
from rlcore.nemo_rl import convert, load_nemo_rl_config, load_nemo_rl_dict, policy_config_from_nemo_rl
from rlcore.nemo_rl.doc import mapping_markdown
from rlcore.nemo_rl.loader import apply_hydra_overrides

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "nemo_rl"
CONFIGS = sorted(FIXTURES.glob("v*/grpo_math_*.yaml"))
runner = CliRunner()


#: Rows shaped like OpenMathInstruct-2's: the fixtures' dataset, which NeMo-RL downloads, as a local file.
MATH_ROWS = FIXTURES / "math.jsonl"


def local_data(path: Path) -> list[str]:
    """The NeMo-RL overrides that point a fixture's dataset at a local file (rlcore reads local files only)."""
    if path.parent.name in ("v0.4.0", "v0.5.0"):  # the flat data section of the early releases
        return [f"++data.data_path={MATH_ROWS}", f"++data.val_data_path={MATH_ROWS}"]
    return [f"++data.train.data_path={MATH_ROWS}"]


def nemo_config(path: Path, overrides: Sequence[str] = (), rlcore_overrides: Sequence[str] = ()) -> Any:
    """:func:`load_nemo_rl_config` on a fixture, its dataset given as a local file."""
    return load_nemo_rl_config(path, [*local_data(Path(path)), *overrides], rlcore_overrides)


def _id(path: Path) -> str:
    return f"{path.parent.name}/{path.stem}"


def nemo_problems(path: Path, *overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        nemo_config(path, overrides)
    return info.value.problems


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# --- NeMo-RL's example GRPO configs ------------------------------------------------------------


def test_the_fixtures_are_the_four_configs_of_four_releases():
    assert {p.parent.name for p in CONFIGS} == {"v0.4.0", "v0.5.0", "v0.6.0", "v0.7.0"}
    assert {p.stem for p in CONFIGS} == {
        "grpo_math_1B",
        "grpo_math_1B_megatron",
        "grpo_math_8B",
        "grpo_math_8B_megatron",
    }
    for path in CONFIGS:
        assert "from https://github.com/NVIDIA-NeMo/RL at tag" in path.read_text().splitlines()[1]


def _expected(nemo: dict[str, Any]) -> dict[str, Any]:
    """What decides training, read straight from the resolved NeMo-RL dict (not through the converter)."""
    p, g, loss = nemo["policy"], nemo["grpo"], nemo["loss_fn"]
    megatron = p["megatron_cfg"]["enabled"] is True
    m = p["megatron_cfg"]
    out = {
        "backend": "megatron" if megatron else "dtensor",
        "gbs": p["train_global_batch_size"],
        "mbs": p["train_micro_batch_size"],
        "lbs": p["logprob_batch_size"],
        "precision": p["precision"],
        "seq": p["max_total_sequence_length"],
        # true = automatic: a run packs where the training backend can (dtensor yes, megatron not without TE)
        "packing": (
            None if p["sequence_packing"]["enabled"] is True else p["sequence_packing"]["enabled"],
            p["sequence_packing"]["train_mb_tokens"],
            p["sequence_packing"]["logprob_mb_tokens"],
            p["sequence_packing"]["algorithm"],
        ),
        "dynamic": p["dynamic_batching"]["enabled"],
        "world": nemo["cluster"]["gpus_per_node"] * nemo["cluster"]["num_nodes"],
        "prompts": (g["num_prompts_per_step"], g["num_generations_per_prompt"]),
        "sampling": (p["generation"]["max_new_tokens"], p["generation"]["temperature"], p["generation"]["top_p"]),
        "loss": (loss["reference_policy_kl_penalty"], loss["ratio_clip_min"], loss["ratio_clip_max"]),
        "divisible": p["make_sequence_length_divisible_by"],
    }
    if megatron:
        out["parallel"] = (
            m["tensor_model_parallel_size"],
            m["context_parallel_size"],
            m["pipeline_model_parallel_size"],
        )
        o = m["optimizer"]
        out["lr"] = o["lr"]
        # main weights: float32 whatever optimizer.params_dtype says (megatron-core's optimizer never reads it)
        out["optimizer"] = (o["optimizer"], o["lr"], o["min_lr"], o["weight_decay"], o["bf16"], "float32")
        out["clip"] = o["clip_grad"]
        out["schedule"] = tuple(
            m["scheduler"][k] for k in ("lr_decay_style", "lr_decay_iters", "lr_warmup_iters", "lr_warmup_init")
        )
    else:
        d = p["dtensor_cfg"]
        out["parallel"] = (d["tensor_parallel_size"], d["context_parallel_size"], 1)
        out["lr"] = p["optimizer"]["kwargs"]["lr"]
        out["optimizer"] = (p["optimizer"]["name"], p["optimizer"]["kwargs"])
        out["clip"] = p["max_grad_norm"]
        out["schedule"] = [(s.get("name", "milestones"), s.get("kwargs"), s.get("milestones")) for s in p["scheduler"]]
    return out


def _got(cfg: Any) -> dict[str, Any]:
    p, g, loss = cfg.policy, cfg.grpo, cfg.loss
    resolved = resolve(cfg).policy
    sp = p.sequence_packing
    out = {
        "backend": p.training_backend,
        "gbs": p.train_global_batch_size,
        "mbs": p.train_micro_batch_size,
        "lbs": p.logprob_batch_size,
        "precision": p.precision,
        "seq": p.max_total_sequence_length,
        "packing": (sp.enabled, sp.train_mb_tokens, sp.logprob_mb_tokens, sp.algorithm),
        "dynamic": p.dynamic_batching.enabled,
        "world": cfg.world_size,
        "prompts": (g.num_prompts_per_step, g.num_generations_per_prompt),
        "sampling": (p.generation.max_new_tokens, p.generation.temperature, p.generation.top_p),
        "loss": (loss.reference_policy_kl_penalty, loss.ratio_clip_min, loss.ratio_clip_max),
        "divisible": p.make_sequence_length_divisible_by,
        "parallel": tuple(resolved.layout.sizes().values()),
        "lr": p.learning_rate,
        "clip": p.max_grad_norm,
    }
    if p.training_backend == "megatron":
        o, s = resolved.section.optimizer, resolved.section.scheduler  # megatron_cfg, as the worker gets it
        out["optimizer"] = (o.optimizer, o.lr, o.min_lr, o.weight_decay, o.bf16, o.params_dtype)
        out["schedule"] = (s.lr_decay_style, s.lr_decay_iters, s.lr_warmup_iters, s.lr_warmup_init)
    else:
        out["optimizer"] = (p.optimizer.name, p.optimizer.kwargs)
        out["schedule"] = [(e.name, getattr(e, "kwargs", None), getattr(e, "milestones", None)) for e in p.scheduler]
    return out


@pytest.mark.parametrize("path", CONFIGS, ids=_id)
def test_example_config_validates_converts_and_keeps_what_decides_training(path: Path, tmp_path: Path):
    loaded = nemo_config(path)
    cfg = loaded.config
    assert cfg.policy.training_backend == ("megatron" if "megatron" in path.stem else "dtensor")
    assert cfg.cluster.use_gpu is True and cfg.policy.generation.backend == "vllm"
    assert _got(cfg) == _expected(load_nemo_rl_dict(path))
    assert cfg.grpo.advantage_estimator == "leave_one_out_std"  # NeMo-RL's default: leave-one-out + normalize
    assert cfg.policy.tokenizer.chat_template == "default"  # no key in NeMo-RL = the tokenizer's own
    # Every ignored key is listed once; the block is the same whatever the entry point.
    lines = loaded.ignored_lines()
    assert len(lines) == len(set(lines)) and all(line.startswith("ignored: ") for line in lines)

    out = tmp_path / "converted.yaml"
    result = runner.invoke(
        app, ["config", "convert", "--from", "nemo-rl", str(path), *local_data(path), "-o", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert load_config(out) == cfg  # the native file is the same config
    result = runner.invoke(app, ["config", "validate", "--no-files", str(out)])  # a GPU config, on any machine
    assert result.exit_code == 0 and result.stdout.startswith(f"OK: {out}"), result.output


def test_validate_and_show_from_nemo_rl_on_the_command_line():
    path = FIXTURES / "v0.7.0" / "grpo_math_8B_megatron.yaml"
    result = runner.invoke(app, ["config", "validate", "--no-files", "--from", "nemo-rl", str(path), *local_data(path)])
    assert result.exit_code == 0, result.output
    assert "training backend: megatron, world size 8" in result.stdout
    ignored = [line for line in result.stderr.splitlines() if line.startswith("ignored: ")]
    assert "ignored: policy.megatron_cfg.moe_permute_fusion (a fused kernel" in "\n".join(ignored)
    assert all(line.startswith("ignored: ") for line in result.stderr.splitlines())
    # NeMo-RL overrides after the file, rlcore overrides with -o.
    result = runner.invoke(
        app,
        [
            "config",
            "show",
            "--from",
            "nemo-rl",
            str(path),
            *local_data(path),
            "policy.max_total_sequence_length=64",
            "-o",
            "cluster.use_gpu=false",
            "--format",
            "json",
        ],
    )
    assert result.exit_code == 0, result.output
    shown = json.loads(result.stdout)
    assert shown["policy"]["generation"]["max_new_tokens"] == 64  # ${policy.max_total_sequence_length}
    assert shown["policy"]["generation"]["vllm_cfg"]["max_model_len"] == 64
    assert shown["cluster"]["use_gpu"] is False
    # A NeMo-RL file read as a native one says what to do.
    result = runner.invoke(app, ["config", "validate", str(path)])
    assert result.exit_code == 1 and result.stderr.splitlines()[-1].endswith("read it with --from nemo-rl")


def test_the_mapping_doc_is_generated_from_the_table():
    doc = REPO / "docs" / "nemo-rl-mapping.md"
    assert doc.read_text() == mapping_markdown(), (
        "docs/nemo-rl-mapping.md is stale: rlcore config nemo-rl-table --write"
    )
    result = runner.invoke(app, ["config", "nemo-rl-table"])
    assert result.exit_code == 0 and result.stdout == mapping_markdown()


def test_every_key_of_the_fixtures_has_a_rule():
    """No fixture key falls to the unknown-key heuristic: the table is complete for these releases."""
    from rlcore.nemo_rl.convert import _Walker

    for path in CONFIGS:
        seen: list[str] = []
        walker = _Walker(load_nemo_rl_dict(path), convert({}))
        walker.unknown = lambda p, v, seen=seen: seen.append(p)  # type: ignore[method-assign]
        walker.walk(walker.nemo, "")
        assert seen == [], (path, seen)


# --- the rule for what rlcore does not implement -------------------------------------------------

BASE = FIXTURES / "v0.7.0" / "grpo_math_1B.yaml"
MEGATRON = FIXTURES / "v0.7.0" / "grpo_math_1B_megatron.yaml"


@pytest.mark.parametrize(
    "path, override, line",
    [
        (
            MEGATRON,
            "++policy.megatron_cfg.moe_router_enable_expert_bias=true",
            "policy.megatron_cfg.moe_router_enable_expert_bias: is true, but rlcore does not support expert-bias",
        ),
        (
            MEGATRON,
            "policy.megatron_cfg.fp8_cfg.enabled=true",
            "policy.megatron_cfg.fp8_cfg.enabled: is true, but rlcore does not support FP8 training",
        ),
        (
            BASE,
            "grpo.async_grpo.in_flight_weight_updates=true",  # mapped; without async GRPO rlcore's rule refuses it
            "grpo.async_grpo.in_flight_weight_updates: is true, but refits land during generation only when",
        ),
        (
            MEGATRON,
            "policy.megatron_cfg.peft.enabled=true",
            "policy.megatron_cfg.peft.enabled: is true, but rlcore does not support LoRA on the megatron backend",
        ),
        (
            BASE,
            "grpo.seq_logprob_error_threshold=0.5",
            "grpo.seq_logprob_error_threshold: is 0.5, but rlcore does not support sequence logprob-error filtering",
        ),
        (BASE, "grpo.adv_estimator.name=opd", "grpo.adv_estimator.name: is 'opd'"),
        (
            BASE,
            "++policy.some_new_feature=3",
            "policy.some_new_feature: is 3, a NeMo-RL key rlcore's reader does not know",
        ),
        (
            BASE,
            "policy.generation.vllm_cfg.kv_cache_dtype=fp8",
            "policy.generation.vllm_cfg.kv_cache_dtype: is 'fp8', but rlcore does not support quantized KV cache",
        ),
    ],
)
def test_a_setting_that_would_change_training_is_an_error_naming_the_path(path, override, line):
    (problem,) = nemo_problems(path, override)
    assert problem.startswith(line), problem


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["loss_fn.use_cispo=true", "loss_fn.ratio_clip_max=0.28"], dict(use_cispo=True, ratio_clip_max=0.28)),
        (
            [
                "loss_fn.use_importance_sampling_correction=true",
                "loss_fn.truncated_importance_sampling_type=seq-mask-tis",
                "loss_fn.truncated_importance_sampling_ratio_min=0.999",
                "loss_fn.truncated_importance_sampling_ratio=1.002",
            ],
            dict(
                truncated_importance_sampling_type="seq-mask-tis",
                truncated_importance_sampling_ratio_min=0.999,
                truncated_importance_sampling_ratio=1.002,
            ),
        ),
        (
            [
                "loss_fn.use_importance_sampling_correction=true",
                "loss_fn.truncated_importance_sampling_type=tis",
                "loss_fn.truncated_importance_sampling_ratio_min=0.5",
                "loss_fn.truncated_importance_sampling_ratio=2.0",
            ],
            dict(truncated_importance_sampling_type="tis", truncated_importance_sampling_ratio_min=0.5),
        ),
    ],
    ids=["cispo", "seq_mask_tis", "tis_min"],
)
def test_nemo_rls_loss_options_convert(overrides, expected):
    conversion = nemo_config(BASE, overrides)
    loss = conversion.config.loss
    assert {key: getattr(loss, key) for key in expected} == expected
    set_keys = [o.split("=")[0] for o in overrides]
    assert not [line for line in conversion.ignored_lines() if any(key in line for key in set_keys)]


def test_dtensor_lora_cfg_becomes_policy_lora():
    cfg = nemo_config(
        BASE,
        [
            "policy.dtensor_cfg.lora_cfg.enabled=true",
            "policy.dtensor_cfg.lora_cfg.dim=16",
            "policy.dtensor_cfg.lora_cfg.target_modules=[q_proj,v_proj]",
            "policy.dtensor_cfg.lora_cfg.match_all_linear=false",
        ],
    ).config
    lora = cfg.policy.lora
    assert (
        lora.enabled,
        lora.dim,
        lora.alpha,
        lora.target_modules,
        lora.match_all_linear,
        lora.dropout_position,
        lora.lora_A_init,
    ) == (True, 16, 32, ["q_proj", "v_proj"], False, "post", "xavier")


def test_async_grpo_carries_over_with_its_rules():
    with pytest.raises(ConfigError) as err:  # NeMo-RL's example colocates generation, which async cannot use
        nemo_config(
            BASE,
            [
                "grpo.async_grpo.enabled=true",
                "grpo.async_grpo.max_trajectory_age_steps=2",
                "loss_fn.use_importance_sampling_correction=true",
            ],
        )
    assert "grpo.async_grpo.enabled: generation can run ahead of training only on its own resources" in str(err.value)
    cfg = nemo_config(
        BASE,
        [
            "grpo.async_grpo.enabled=true",
            "grpo.async_grpo.max_trajectory_age_steps=2",
            "loss_fn.use_importance_sampling_correction=true",
            "policy.generation.colocated.enabled=false",
            "cluster.gpus_per_node=2",
            "policy.generation.colocated.resources.gpus_per_node=1",
            "policy.generation.colocated.resources.num_nodes=1",
        ],
    ).config
    assert (cfg.grpo.async_grpo.enabled, cfg.grpo.async_grpo.max_trajectory_age_steps) == (True, 2)


def test_switched_off_features_and_neutral_values_are_ignored_once():
    loaded = nemo_config(MEGATRON, ["++policy.some_new_feature=null"])
    lines = loaded.ignored_lines()
    for path in (
        "policy.megatron_cfg.fp8_cfg",
        "policy.megatron_cfg.peft",
        "policy.dtensor_cfg",
        "policy.some_new_feature",
        "data.default.processor",
    ):
        assert sum(line.startswith(f"ignored: {path} (") for line in lines) == 1, (path, lines)
    # A section that is switched off is one line, not one per key.
    assert not any(line.startswith("ignored: policy.megatron_cfg.fp8_cfg.") for line in lines)


@pytest.mark.parametrize("path", [BASE, FIXTURES / "main" / "grpo_math_1B.yaml"], ids=_id)
def test_nemo_rls_reward_and_advantage_options_convert(path):
    """DAPO's and ProRL's GRPO options, turned on in NeMo-RL's own example config, arrive as the same values."""
    conversion = nemo_config(
        path,
        [
            "grpo.max_rollout_turns=3",
            "grpo.overlong_filtering=true",
            "grpo.advantage_clip_low=-5",
            "grpo.advantage_clip_high=5.5",
            "grpo.use_dynamic_sampling=true",
            "grpo.dynamic_sampling_max_gen_batches=4",
            "grpo.batch_multiplier=1.5",
            "grpo.reward_shaping.enabled=true",
            "grpo.reward_shaping.overlong_buffer_length=64",
            "grpo.reward_shaping.overlong_buffer_penalty=0.5",
            "policy.max_total_sequence_length=1024",
            "grpo.reward_scaling.enabled=true",
            "grpo.reward_scaling.target_min=-1.0",
            "grpo.reward_scaling.source_max=2",
        ],
    )
    g = conversion.config.grpo
    assert (g.max_rollout_turns, g.overlong_filtering, g.advantage_clip_low, g.advantage_clip_high) == (
        3,
        True,
        -5,
        5.5,
    )
    assert (g.use_dynamic_sampling, g.dynamic_sampling_max_gen_batches, g.batch_multiplier) == (True, 4, 1.5)
    assert g.prompts_per_generation_batch == int(g.num_prompts_per_step * 1.5)  # NeMo-RL rounds down too
    sh, sc = g.reward_shaping, g.reward_scaling
    # max_response_length: ${policy.max_total_sequence_length} in the file, resolved after the override
    assert (
        sh.enabled,
        sh.overlong_buffer_length,
        sh.overlong_buffer_penalty,
        sh.max_response_length,
        sh.stop_properly_penalty_coef,
    ) == (True, 64, 0.5, 1024, None)
    assert (sc.enabled, sc.source_min, sc.source_max, sc.target_min, sc.target_max) == (True, 0.0, 2.0, -1.0, 1.0)
    ignored = "\n".join(conversion.ignored_lines())
    assert not any(
        k in ignored
        for k in (
            "max_rollout_turns",
            "overlong_filtering",
            "advantage_clip",
            "dynamic_sampling",
            "batch_multiplier",
            "reward_shaping",
            "reward_scaling",
        )
    )
    # ProRL's truncation penalty, the DAPO keys of the file still there
    cfg = nemo_config(
        path, ["grpo.reward_shaping.enabled=true", "grpo.reward_shaping.stop_properly_penalty_coef=0.0"]
    ).config
    assert (cfg.grpo.reward_shaping.stop_properly_penalty_coef, cfg.grpo.reward_shaping.overlong_buffer_length) == (
        0.0,
        128,
    )


def test_nemo_rls_refusals_of_the_reward_options_carry_over():
    (problem,) = nemo_problems(BASE, "grpo.batch_multiplier=2")  # NeMo-RL asserts it is 1 without dynamic sampling
    assert problem.startswith("grpo.batch_multiplier: is 2.0, but it only sizes the generation batches"), problem
    problems = nemo_problems(
        BASE,
        "grpo.async_grpo.enabled=true",
        "grpo.reward_scaling.enabled=true",
        "loss_fn.use_importance_sampling_correction=true",
        "policy.generation.colocated.enabled=false",
        "cluster.gpus_per_node=2",
        "policy.generation.colocated.resources.gpus_per_node=1",
        "policy.generation.colocated.resources.num_nodes=1",
    )
    assert len(problems) == 1 and "not supported with async GRPO" in problems[0], problems


def test_the_backend_context_parallel_and_clipping_follow_nemo_rl():
    # Context parallel needs CUDA: fine for the GPU cluster NeMo-RL describes, an error before any
    # process starts when the cluster has no GPU.
    assert (
        resolve(
            nemo_config(BASE, ["policy.dtensor_cfg.context_parallel_size=2", "cluster.gpus_per_node=2"]).config
        ).policy.layout.cp
        == 2
    )
    with pytest.raises(ConfigError, match="context parallel needs CUDA"):
        resolve(
            nemo_config(
                BASE,
                ["policy.dtensor_cfg.context_parallel_size=2", "cluster.gpus_per_node=2"],
                ["cluster.use_gpu=false"],
            ).config
        )
    # megatron clips by megatron_cfg.optimizer.clip_grad (0 = off); dtensor by max_grad_norm.
    cfg = nemo_config(MEGATRON, ["policy.megatron_cfg.optimizer.clip_grad=0.0"]).config
    assert cfg.policy.max_grad_norm is None
    assert nemo_config(BASE, ["policy.max_grad_norm=null"]).config.policy.max_grad_norm is None
    # neither backend enabled: fsdp1 (rlcore's and older NeMo-RL's third worker)
    cfg = nemo_config(BASE, ["policy.dtensor_cfg.enabled=false"]).config
    assert cfg.policy.training_backend == "fsdp1"


def test_problems_after_conversion_name_the_nemo_rl_key_they_came_from():
    assert nemo_problems(BASE, "cluster.gpus_per_node=0") == [
        "cluster.workers_per_node (NeMo-RL: cluster.gpus_per_node): expected a value > 0, got 0"
    ]
    assert nemo_problems(BASE, "logger.log_dir=7") == [
        "logger.output_dir (NeMo-RL: logger.log_dir): expected a string, got 7"
    ]


@pytest.mark.parametrize(
    "colocated, cluster, resources, expect",
    [
        (False, (8, 1), {"gpus_per_node": 2, "num_nodes": None}, ((1, 6), (1, 2))),
        (False, (8, 4), {"gpus_per_node": 8, "num_nodes": 1}, ((3, 8), (1, 8))),
        (True, (8, 2), {"gpus_per_node": None, "num_nodes": None}, ((2, 8), None)),
    ],
)
def test_cluster_and_generation_resources_split_like_nemo_rl(colocated, cluster, resources, expect):
    gpus, nodes = cluster
    overrides = [
        f"cluster.gpus_per_node={gpus}",
        f"cluster.num_nodes={nodes}",
        f"policy.generation.colocated.enabled={str(colocated).lower()}",
        *(f"policy.generation.colocated.resources.{k}={'null' if v is None else v}" for k, v in resources.items()),
        "policy.train_global_batch_size=480",
        "policy.train_micro_batch_size=1",
        "grpo.num_prompts_per_step=30",
    ]
    cfg = nemo_config(BASE, overrides).config
    assert (cfg.cluster.num_nodes, cfg.cluster.workers_per_node) == expect[0]
    res = cfg.policy.generation.colocated.resources
    assert (None if res is None else (res.num_nodes, res.workers_per_node)) == expect[1]


def test_non_colocated_generation_needs_nemo_rl_resources():
    (problem,) = nemo_problems(BASE, "policy.generation.colocated.enabled=false")
    assert problem.startswith("policy.generation.colocated.resources.gpus_per_node: is null; with cluster.num_nodes 1")


@pytest.mark.parametrize(
    "loo, normalize, estimator",
    [
        (True, True, "leave_one_out_std"),
        (True, False, "leave_one_out"),
        (False, True, "mean_std"),
        (False, False, "mean"),
    ],
)
def test_advantage_options_map_to_an_estimator(loo, normalize, estimator):
    overrides = [
        f"grpo.use_leave_one_out_baseline={str(loo).lower()}",
        f"grpo.normalize_rewards={str(normalize).lower()}",
    ]  # adv_estimator.* interpolate these
    assert nemo_config(BASE, overrides).config.grpo.advantage_estimator == estimator


def test_chat_template_keeps_nemo_rl_values():
    assert (
        nemo_config(BASE, ["++policy.tokenizer.chat_template=null"]).config.policy.tokenizer.chat_template is None
    )  # passthrough
    cfg = nemo_config(BASE, ["++policy.tokenizer.chat_template='{{ messages[0].content }}!'"]).config
    assert cfg.policy.tokenizer.chat_template == "{{ messages[0].content }}!"


def test_scheduler_forms_and_optimizer_null():
    cfg = nemo_config(BASE).config
    assert [e.name for e in cfg.policy.scheduler] == [
        "torch.optim.lr_scheduler.LinearLR",
        "torch.optim.lr_scheduler.ConstantLR",
        "milestones",
    ]
    assert cfg.policy.scheduler[2].milestones == [50]
    assert nemo_config(BASE, ["policy.scheduler=null"]).config.policy.scheduler is None
    (problem,) = nemo_problems(BASE, "++policy.optimizer.kwargs.weigth_decay=0.1")
    assert problem == (
        "policy.optimizer.kwargs.weigth_decay: not an argument of torch.optim.AdamW; did you mean 'weight_decay'?"
    )
    loaded = nemo_config(MEGATRON)  # optimizer: null (the megatron backend has its own)
    assert "ignored: policy.optimizer (the megatron backend uses megatron_cfg.optimizer)" in loaded.ignored_lines()
    megatron = resolve(loaded.config).policy.section
    assert loaded.config.policy.learning_rate == megatron.optimizer.lr == 5e-6


def test_a_nemo_rl_policy_dict_becomes_a_policy_config():
    nemo = load_nemo_rl_dict(BASE)
    policy = policy_config_from_nemo_rl(nemo["policy"])
    assert policy.training_backend == "dtensor"
    assert policy.sequence_packing.enabled is None  # NeMo-RL's true: automatic, packed where the backend can
    with pytest.raises(ConfigError, match="policy.megatron_cfg.peft.enabled: is true"):
        policy_config_from_nemo_rl(
            {
                **nemo["policy"],
                "megatron_cfg": {**nemo["policy"]["megatron_cfg"], "enabled": True, "peft": {"enabled": True}},
            }
        )


# --- the loader: defaults, interpolation, overrides -------------------------------------------------


def test_defaults_chains_merge_like_omegaconf(tmp_path):
    write(tmp_path, "base/grand.yaml", "a: {x: 1, y: [1, 2], z: {k: 1}}\nb: 1\n")
    write(tmp_path, "base/parent.yaml", "defaults: grand.yaml\na: {x: 2}\nc: ${a.x}\n")
    write(tmp_path, "other.yaml", "d: 4\nb: 5\n")
    child = write(
        tmp_path,
        "child.yaml",
        "defaults: [base/parent.yaml, other.yaml]\na: {y: [3], z: {_override_: true, j: 2}}\nb: 7\n",
    )
    data = load_nemo_rl_dict(child)
    assert data == {"a": {"x": 2, "y": [3], "z": {"j": 2}}, "b": 7, "c": 2, "d": 4}
    write(tmp_path, "loop_a.yaml", "defaults: loop_b.yaml\n")
    loop = write(tmp_path, "loop_b.yaml", "defaults: loop_a.yaml\n")
    with pytest.raises(ConfigError, match="defaults cycle"):
        load_nemo_rl_dict(loop)
    with pytest.raises(ConfigError, match="no such file"):
        load_nemo_rl_dict(write(tmp_path, "missing.yaml", "defaults: nope.yaml\n"))


def test_interpolations_resolvers_and_relative_references(tmp_path, monkeypatch):
    monkeypatch.setenv("RLCORE_TEST_HOME", "/data")
    path = write(
        tmp_path,
        "c.yaml",
        "\n".join(
            [
                "p:",
                "  seq: 512",
                "  mbs: 4",
                "  lbs: ${.mbs}",
                "  tokens: ${mul:${p.seq}, ${p.lbs}}",
                "  half: ${div:${.seq},2}",
                "  big: ${max:${.seq}, 1024}",
                "  sub:",
                "    up: ${..seq}",
                "    text: 'n=${..mbs}!'",
                "  home: ${oc.env:RLCORE_TEST_HOME}/x",
                "  dflt: ${oc.env:RLCORE_NOT_SET_ANYWHERE,7}",
                "  sel: ${oc.select:p.nothing,fallback}",
                "",
            ]
        ),
    )
    p = load_nemo_rl_dict(path)["p"]
    assert (p["lbs"], p["tokens"], p["half"], p["big"]) == (4, 2048, 256.0, 1024)
    assert p["sub"] == {"up": 512, "text": "n=4!"} and p["home"] == "/data/x" and p["dflt"] == 7
    assert p["sel"] == "fallback"
    # An override reaches every interpolation that names the key.
    assert load_nemo_rl_dict(path, ["p.seq=64"])["p"]["tokens"] == 256
    bad = write(tmp_path, "bad.yaml", "a: ${b}\nc: ${c}\nd: ${foo:1}\ne: ???\n")
    with pytest.raises(ConfigError) as info:
        load_nemo_rl_dict(bad)
    assert info.value.problems == [
        "a: cannot resolve '${b}': 'b' does not exist",
        "c: cannot resolve '${c}': interpolation cycle: c -> c",
        "d: cannot resolve '${foo:1}': unknown resolver 'foo' (rlcore knows div, max, mul, oc.env, oc.select)",
        "e: is '???' (a value the config leaves to you): set it with an override, e.g. e=...",
    ]


def test_hydra_overrides():
    cfg = {"policy": {"model": "m", "gen": {"t": 1.0}}, "grpo": {"steps": 3}}
    out = apply_hydra_overrides(
        cfg, ["policy.model=x", "++policy.gen.top_k=5", "+policy.new=[1, 2]", "~grpo.steps", "++a.b.c=null"]
    )
    assert out == {
        "policy": {"model": "x", "gen": {"t": 1.0, "top_k": 5}, "new": [1, 2]},
        "grpo": {},
        "a": {"b": {"c": None}},
    }
    assert cfg["grpo"] == {"steps": 3}  # the input is not changed
    with pytest.raises(ConfigError) as info:
        apply_hydra_overrides(cfg, ["policy.modle=x", "+policy.model=y", "~nope", "justakey"])
    assert info.value.problems == [
        "override 'policy.modle=x': 'policy.modle' is not in the config; did you mean 'model'?",
        "override '+policy.model=y': 'policy.model' already exists; set it with policy.model=y or ++policy.model=y",
        "override '~nope': 'nope' does not exist",
        "override 'justakey': expected key=value, +key=value, ++key=value or ~key with a dotted key, e.g. "
        "policy.train_micro_batch_size=2",
    ]


def test_the_reader_stays_light():
    code = (
        "import sys; from rlcore.nemo_rl import load_nemo_rl_config; "
        f"load_nemo_rl_config({str(BASE)!r}, {local_data(BASE)!r}); "
        "print(sorted(m for m in ('torch', 'ray', 'numpy', 'transformers', 'vllm') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stderr


def test_native_configs_still_reject_nemo_rl_positional_overrides(tmp_path):
    path = write(tmp_path, "c.yaml", "policy: {}\n")
    result = runner.invoke(app, ["config", "validate", str(path), "policy.precision=bfloat16"])
    assert result.exit_code == 1 and "are for --from nemo-rl" in result.stderr


# --- one real run -------------------------------------------------------------------------------------


def test_rlcore_run_from_nemo_rl_trains_the_tiny_model_end_to_end(tmp_path):
    """NeMo-RL's own 1B dtensor GRPO config as a user runs it, offline: no data override, its OpenMathInstruct-2
    read from a hub cache built here (nvidia/OpenMathInstruct-2's train_1M split, 5% held out for validation as
    the config says); only the model and the sizes a CPU needs are changed."""
    import os

    from tests.support.hub_cache import hub_cache

    home = tmp_path / "hf"
    rows = [{"problem": f"What is {a} + {a + 1}?", "expected_answer": str(2 * a + 1)} for a in range(80)]
    hub_cache(home, "nvidia/OpenMathInstruct-2", {"data/train_1M-00000-of-00001.parquet": rows})
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    for name in ("HF_HUB_CACHE", "HF_DATASETS_CACHE"):
        env.pop(name, None)
    nemo_overrides = [
        "policy.model_name=tiny-llama",
        "cluster.gpus_per_node=1",
        "policy.precision=float32",  # 1 rank, 1 engine
        "policy.train_global_batch_size=8",
        "policy.train_micro_batch_size=2",
        "policy.max_total_sequence_length=48",  # max_new_tokens follows: completions get cut to fit
        "policy.generation.vllm_cfg.enforce_eager=true",
        "grpo.num_prompts_per_step=4",
        "grpo.num_generations_per_prompt=2",
        "grpo.max_num_steps=2",
        "checkpointing.enabled=false",
        "grpo.val_period=1",
        "grpo.val_batch_size=4",
        "grpo.max_val_samples=4",
        f"logger.log_dir={tmp_path / 'run'}",
        "data.default.prompt_file=null",
        "env.math.num_workers=0",
    ]
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlcore",
            "run",
            "--from",
            "nemo-rl",
            str(BASE),
            *nemo_overrides,
            "-o",
            "cluster.use_gpu=false",
            "-o",
            "logger.progress_bar=false",
        ],
        capture_output=True,
        text=True,
        timeout=540,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ignored: policy.generation.vllm_cfg.use_tqdm (" in out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 2
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in logged if "token_mult_prob_error" in r]
    assert [r["step"] for r in rows] == [0, 1]
    assert any(r.get("validation/num_samples") == 4 for r in logged)  # 4 of the 5% held out (80 rows: 4)
    prompt_tokens = 48 - max(r["mean_generation_length"] for r in rows)
    assert prompt_tokens > 0  # prompt + completion fit policy.max_total_sequence_length
    assert all(abs(r["token_mult_prob_error"] - 1.0) < 1e-3 for r in rows)  # engine == trainer, after refit


@pytest.mark.parametrize(
    "minus_baseline, estimator", [(True, "reinforce_plus_plus_baseline"), (False, "reinforce_plus_plus")]
)
def test_reinforce_plus_plus_converts(minus_baseline, estimator):
    conversion = nemo_config(
        BASE,
        [
            "grpo.adv_estimator.name=reinforce_plus_plus",
            f"grpo.adv_estimator.minus_baseline={str(minus_baseline).lower()}",
            "loss_fn.use_kl_in_reward=true",
            "loss_fn.reference_policy_kl_penalty=0.01",
        ],
    )
    cfg = conversion.config
    assert (cfg.grpo.advantage_estimator, cfg.loss.use_kl_in_reward) == (estimator, True)
    ignored = "\n".join(conversion.ignored_lines())
    assert "grpo.adv_estimator.use_leave_one_out_baseline (grpo only)" in ignored
    assert "grpo.normalize_rewards (grpo advantages only)" in ignored


def test_kl_in_reward_with_grpo_advantages_is_an_error_not_a_dropped_kl():
    with pytest.raises(ConfigError, match=r"loss.use_kl_in_reward .*: only the Reinforce\+\+ advantages"):
        nemo_config(BASE, ["loss_fn.use_kl_in_reward=true", "loss_fn.reference_policy_kl_penalty=0.01"])


def test_a_loss_fn_without_a_kl_coefficient_keeps_nemo_rls_default():
    assert nemo_config(BASE, ["~loss_fn.reference_policy_kl_penalty"]).config.loss.reference_policy_kl_penalty == 0.01
    assert nemo_config(BASE, ["loss_fn.reference_policy_kl_penalty=0.0"]).config.loss.reference_policy_kl_penalty == 0.0


def test_nemo_rl_main_branch_config_converts_its_task():
    """NeMo-RL's main branch (7ea279abf, 2026-08-22): the release layout plus validation keys of its own."""
    path = FIXTURES / "main" / "grpo_math_1B.yaml"
    loaded = load_nemo_rl_config(path, [f"++data.train.data_path={MATH_ROWS}"])
    cfg = loaded.config
    assert (cfg.data.input_key, cfg.data.output_key, cfg.env.name) == ("problem", "expected_answer", "math")
    assert cfg.data.train.path == str(MATH_ROWS) and cfg.data.split_validation_size == 0.05
    assert cfg.checkpointing.metric_name == "validation/accuracy"
    assert any(line.startswith("ignored: grpo.val_start_at (") for line in loaded.ignored_lines())
    problems = nemo_problems(path, "grpo.val_num_generations_per_prompt=4", f"++data.train.data_path={MATH_ROWS}")
    assert problems[0].startswith("grpo.val_num_generations_per_prompt: is 4, but rlcore does not support")


def test_a_dapo_math_config_reads_the_nested_rows_of_dapo_math_17k(tmp_path):
    """DAPO-Math-17k's rows: the prompt is a message log, the answer sits in reward_model.ground_truth. A NeMo-RL
    config naming the dataset, given a local parquet copy, reads both."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from rlcore.datasets import SampleBuilder, read_rows

    rows = [
        {
            "data_source": "math_dapo",
            "prompt": [{"content": f"What is {i} + 1?", "role": "user"}],
            "ability": "MATH",
            "reward_model": {"ground_truth": str(i + 1), "style": "rule-lighteval/MATH_v2"},
            "extra_info": {"index": f"id-{i}"},
        }
        for i in range(3)
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "dapo.parquet")
    cfg = nemo_config(
        BASE,
        [
            "++data.train.dataset_name=DAPOMath17K",
            "data.default.prompt_file=null",
            f"++data.train.data_path={tmp_path / 'dapo.parquet'}",
        ],
    ).config
    assert (cfg.data.messages_key, cfg.data.output_key) == ("prompt", "reward_model.ground_truth")
    builder = SampleBuilder(cfg.data)
    samples = [builder.sample(row, i, f"row {i + 1}") for i, row in enumerate(read_rows(cfg.data.train.path))]
    assert [s.messages[-1] for s in samples] == [{"role": "user", "content": f"What is {i} + 1?"} for i in range(3)]
    assert [s.metadata["ground_truth"] for s in samples] == ["1", "2", "3"]
    assert samples[2].metadata["extra_info"] == {"index": "id-2"}  # the other columns ride along as metadata
    hub = nemo_config(
        BASE, ["++data.train.dataset_name=DAPOMath17K", "data.default.prompt_file=null", "~data.train.data_path"]
    ).config
    assert (hub.data.train.hub_id, hub.data.messages_key) == ("BytedTsinghua-SIA/DAPO-Math-17k", "prompt")
