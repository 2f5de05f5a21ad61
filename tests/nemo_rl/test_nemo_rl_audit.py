"""Issue 52 item 1 and issue 53: no accepted NeMo-RL key that decides the task, data, reward, loss, sampling or
model is dropped with an ``ignored:`` line; the keys that change nothing computed are ignored saying why.

The reference for each verdict is NeMo-RL's own source at the fixtures' commit (cited per test). The set of
keys ignored whatever their value is pinned here: a new ignore rule fails this file until it is reviewed.
"""

from __future__ import annotations

from pathlib import Path

from rlcore.nemo_rl import load_nemo_rl_dict, tasks
from rlcore.nemo_rl.conversion import Conversion
from rlcore.nemo_rl.convert import convert
from rlcore.nemo_rl.table import RULES

FIXTURES = Path(__file__).parents[1] / "fixtures" / "nemo_rl"
MAIN = FIXTURES / "main"
GRPO = MAIN / "grpo_math_1B.yaml"
ROWS = FIXTURES / "math.jsonl"

#: Every ``ignore`` rule, reviewed (issue 52 item 1): each changes no number rlcore computes. Ports, logging,
#: memory placement, kernel and fusion choices, transports, checkpoint layout, MoE kernel and dispatch-backend
#: keys (rl-megatron honours the MoE keys that change the numbers), NeMo-RL worker implementation switches, and
#: validation sampling (rlcore validates greedily, docs/tasks.md: a reported metric, not training).
REVIEWED_IGNORE_RULES = {
    "checkpointing.checkpoint_dir",
    "checkpointing.save_consolidated",
    "cluster.master_port_range_high",
    "cluster.master_port_range_low",
    "cluster.segment_size",
    "data.*.system_prompt_file",
    "grpo.debug_payload_metrics",
    "grpo.deduplicate_multimodal_data",
    "logger",
    "policy.disable_modelopt_layer_spec",
    "policy.dtensor_cfg._v2",
    "policy.dtensor_cfg.clear_cache_every_n_steps",
    "policy.dtensor_cfg.defer_fsdp_grad_sync",
    "policy.dtensor_cfg.lora_cfg.use_triton",
    "policy.dtensor_cfg.moe_parallelizer",
    "policy.generation.mcore_generation_config",
    "policy.generation.port_range_high",
    "policy.generation.port_range_low",
    "policy.generation.real_quant_export_cpu_offload",
    "policy.generation.refit_cfg",
    "policy.generation.refit_transport",
    "policy.generation.trtllm_kwargs",
    "policy.generation.val_temperature",
    "policy.generation.val_top_k",
    "policy.generation.val_top_p",
    "policy.generation.vllm_cfg.enable_vllm_metrics_logger",
    "policy.generation.vllm_cfg.use_deep_gemm",
    "policy.generation.vllm_cfg.use_tqdm",
    "policy.generation.vllm_cfg.vllm_metrics_logger_interval",
    "policy.megatron_cfg.apply_rope_fusion",
    "policy.megatron_cfg.attention_backend",
    "policy.megatron_cfg.bias_activation_fusion",
    "policy.megatron_cfg.checkpoint.async_save",
    "policy.megatron_cfg.checkpoint.ckpt_assume_constant_structure",
    "policy.megatron_cfg.clear_memory_caches_before_refit",
    "policy.megatron_cfg.cuda_graph_impl",
    "policy.megatron_cfg.cuda_graph_warmup_steps",
    "policy.megatron_cfg.force_reconvert_from_hf",
    "policy.megatron_cfg.fused_linear_logprobs_chunk_size",
    "policy.megatron_cfg.gradient_accumulation_fusion",
    "policy.megatron_cfg.hybridep_*",
    "policy.megatron_cfg.inference_grouped_gemm_backend",
    "policy.megatron_cfg.inference_moe_token_dispatcher_type",
    "policy.megatron_cfg.linear_ce_fusion_chunk_size",
    "policy.megatron_cfg.moe_flex_dispatcher_backend",
    "policy.megatron_cfg.moe_grouped_gemm",
    "policy.megatron_cfg.moe_hybridep_num_sms",
    "policy.megatron_cfg.moe_pad_experts_for_cuda_graph_inference",
    "policy.megatron_cfg.moe_per_layer_logging",
    "policy.megatron_cfg.moe_permute_fusion",
    "policy.megatron_cfg.moe_shared_expert_overlap",
    "policy.megatron_cfg.optimizer.optimizer_cpu_offload",
    "policy.megatron_cfg.optimizer.params_dtype",  # megatron-core's optimizer never reads it (main_params_dtype)
    "policy.megatron_cfg.optimizer.optimizer_offload_fraction",
    "policy.megatron_cfg.transformer_impl",
    "policy.megatron_cfg.use_fused_linear_logprobs",
    "policy.megatron_cfg.use_fused_weighted_squared_relu",
    "policy.megatron_cfg.use_linear_ce_fusion_loss",
    "policy.offload_optimizer_for_logprob",
    "policy.refit_buffer_size_gb",
    "policy.sequence_packing.fuse_loss",
    "policy.sequence_packing.microbatch_order",
    "policy.sequence_packing.sequence_length_round",
}
#: The data and math-environment keys the task reader ignores whatever their value, reviewed the same way.
REVIEWED_TASK_IGNORES = {"num_workers", "seed", "task_name", "dataset_name", "split", "stop_strings"}


def test_every_key_ignored_whatever_its_value_is_a_reviewed_one():
    ignore_rules = {rule.nemo for rule in RULES if rule.action == "ignore"}
    assert ignore_rules == REVIEWED_IGNORE_RULES, (
        "an ignore rule was added or removed: review whether the key changes what is trained (then refuse it or "
        f"build it) and update this set; added {sorted(ignore_rules - REVIEWED_IGNORE_RULES)}, removed "
        f"{sorted(REVIEWED_IGNORE_RULES - ignore_rules)}"
    )
    assert set(tasks.IGNORED) | set(tasks.MATH_ENV_UNREAD) == REVIEWED_TASK_IGNORES


def convert_file(path: Path, overrides: list[str] | tuple[str, ...] = ()) -> Conversion:
    return convert(load_nemo_rl_dict(path, overrides))


def _problems_and_ignored(path: Path, *overrides: str) -> tuple[list[str], dict[str, str]]:
    out = convert_file(path, [f"++data.train.data_path={ROWS}", *overrides])
    return out.problems, dict(out.ignored)


def test_several_train_datasets_are_refused_not_silently_replaced_by_the_default_task():
    # NeMo-RL concatenates a list of datasets (nemo_rl/data/utils.py, setup_response_data); before this, the list
    # was dropped and the run trained on rlcore's default generator task.
    out = convert_file(MAIN / "grpo_multiple_datasets.yaml")
    train = [line for line in out.problems if line.startswith("data.train: is a list of 2 datasets")]
    validation = [line for line in out.problems if line.startswith("data.validation: is a list of 2 datasets")]
    assert len(train) == 1 and "OpenMathInstruct-2, DeepScaler" in train[0] and "++data.train=" in train[0]
    assert len(validation) == 1 and "AIME2024" in validation[0]


def test_max_input_seq_length_is_rlcores_same_rule_with_one_value_for_every_split():
    """NeMo-RL masks a prompt this long out of the loss: converted as is (rlcore's data.max_input_seq_length); a
    split asking for another limit is refused, since rlcore has one; null is ignored."""
    out = convert_file(GRPO, ["data.max_input_seq_length=256"])
    assert out.problems == [] and out.config["data"]["max_input_seq_length"] == 256
    out = convert_file(GRPO, ["data.max_input_seq_length=256", "++data.train.max_input_seq_length=128"])
    assert out.problems == [
        "data.train.max_input_seq_length: is 128, but data.max_input_seq_length is 256: rlcore has one limit "
        "for every split (data.max_input_seq_length); give one value"
    ]
    out = convert_file(GRPO, ["data.max_input_seq_length=null"])
    assert "data.max_input_seq_length" not in out.config.get("data", {})
    assert dict(out.ignored)["data.max_input_seq_length"].startswith("null")


def test_a_data_section_naming_no_train_dataset_is_refused():
    out = convert_file(GRPO, ["~data.train"])
    assert any(line.startswith("data.train: the data section names no train dataset") for line in out.problems)


def test_data_keys_that_decide_the_prompts_are_refused_and_the_neutral_ones_ignored_with_why():
    problems, ignored = _problems_and_ignored(GRPO)
    assert problems == []
    assert "math_hf_data_processor" in ignored["data.default.processor"]
    assert "data.max_input_seq_length" not in ignored  # NeMo-RL's rule, rlcore's same-named key
    assert ignored["data.use_multiple_dataloader"].startswith("false")
    problems, _ = _problems_and_ignored(
        GRPO,
        "data.default.processor=vlm_hf_data_processor",
        "data.use_multiple_dataloader=true",
        "++data.train.text_key=text",
    )
    lines = {line.split(":")[0]: line for line in problems}
    assert "'vlm_hf_data_processor'" in lines["data.default.processor"]
    assert "data.num_prompts_per_dataloader" in lines["data.use_multiple_dataloader"]
    assert "data.train.text_key" in lines and "not dropped" in lines["data.train.text_key"]


def test_a_math_grader_other_than_math_is_refused_and_the_unread_stop_strings_ignored():
    # nemo_rl/environments/math_environment.py: verifier_type picks the worker (multiple-choice graders score a
    # letter); MathEnvConfig.stop_strings is declared and read nowhere.
    problems, ignored = _problems_and_ignored(
        GRPO, "++env.math.verifier_type=english_multichoice", "++env.math.stop_strings=[</answer>]"
    )
    assert any(line.startswith("env.math.verifier_type: is 'english_multichoice'") for line in problems)
    assert "read nowhere" in ignored["env.math.stop_strings"]
    problems, ignored = _problems_and_ignored(GRPO, "++env.math.verifier_type=math")
    assert problems == [] and "env.math.verifier_type" in ignored


def test_the_transfer_queue_data_plane_is_transport_and_the_single_controller_loop_is_asynchronous_grpo():
    # examples/run_grpo.py picks grpo_train_sync (the same loop through TransferQueue) on data_plane.enabled;
    # examples/run_grpo_single_controller.py (async_rl) streams rollouts ahead of training, refitting in flight:
    # rlcore's asynchronous GRPO with in-flight weight updates (tests/nemo_rl/test_single_controller_mapping.py).
    problems, ignored = _problems_and_ignored(GRPO, "data_plane.enabled=true")
    assert problems == [] and "parity-tested" in ignored["data_plane"]
    out = convert_file(MAIN / "grpo_math_1B_megatron_single_controller.yaml")
    assert out.problems == [] and out.config["grpo"]["async_grpo"]["in_flight_weight_updates"] is True
    problems, ignored = _problems_and_ignored(GRPO, "++async_rl.sampler.name=in_order")
    assert problems == [] and "refuses to start without data_plane.enabled" in ignored["async_rl"]
    problems, _ = _problems_and_ignored(GRPO, "data_plane.enabled=true", "grpo.async_grpo.enabled=true")
    assert any(line.startswith("grpo.async_grpo.enabled: is true with data_plane.enabled") for line in problems)


def test_keys_that_change_nothing_computed_are_accepted_with_their_reason_whatever_their_value():
    # NeMo-RL's SequencePackingFusionLossWrapper (nemo_rl/algorithms/loss/wrapper.py): "numerically identical";
    # segment_size only filters placement bundles (nemo_rl/distributed/virtual_cluster.py).
    problems, ignored = _problems_and_ignored(
        GRPO, "cluster.segment_size=4", "++policy.sequence_packing.fuse_loss=true"
    )
    assert problems == []
    assert "NVLink" in ignored["cluster.segment_size"]
    assert "numerically identical" in ignored["policy.sequence_packing.fuse_loss"]


def test_dapo_math_verify_maps_to_rlcore_s_dapo_grader():
    out = convert_file(GRPO, [f"++data.train.data_path={ROWS}", "env.math.math_verify_impl=dapo_math_verify"])
    assert out.problems == [] and out.config["env"]["math_cfg"] == {"verifier": "dapo"}
    assert out.sources["env.math_cfg.verifier"] == "env.math.math_verify_impl"


def test_the_qwen3_moe_recipe_converts_with_its_expert_parallelism_as_written():
    """NeMo-RL main's grpo_math_qwen30ba3b_megatron.yaml: its MoE settings reach rl-megatron as written (which
    honours or refuses each), its kernel choices are ignored saying why, and nothing is refused."""
    out = convert_file(MAIN / "grpo_math_qwen30ba3b_megatron.yaml")
    assert out.problems == []
    megatron = out.config["policy"]["megatron_cfg"]
    assert (megatron["expert_model_parallel_size"], megatron["expert_tensor_parallel_size"]) == (8, 1)
    assert megatron["sequence_parallel"] is True and megatron["moe_token_dispatcher_type"] == "alltoall"
    assert megatron["moe_router_dtype"] == "fp64" and megatron["freeze_moe_router"] is True
    assert out.config["policy"]["env_vars"] == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}
    ignored = dict(out.ignored)
    assert "the same token permutation" in ignored["policy.megatron_cfg.moe_permute_fusion"]
    assert not any(key.startswith("policy.megatron_cfg.moe_router") for key in ignored)
