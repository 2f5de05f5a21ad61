"""``policy.env_vars`` (NeMo-RL's ``dtensor_cfg.env_vars`` / ``megatron_cfg.env_vars``): set in every training
worker process of the policy; names rlcore's runtime owns are refused before anything starts (issue 53)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlcore.config import ConfigError, load_config_dict
from rlcore.nemo_rl import load_nemo_rl_config

FIXTURES = Path(__file__).parents[1] / "fixtures" / "nemo_rl"


def test_names_the_runtime_sets_are_refused_naming_the_dotted_path():
    with pytest.raises(ConfigError) as caught:
        load_config_dict({"policy": {"env_vars": {"MASTER_ADDR": "x", "RLCORE_WORKER_NAME": "y", "FINE": "1"}}})
    [line] = caught.value.problems
    assert line.startswith("policy.env_vars") and "MASTER_ADDR, RLCORE_WORKER_NAME: set by rlcore" in line
    assert "FINE" not in line


def test_nemo_rl_s_env_vars_of_the_active_backend_map_and_the_inactive_one_s_are_ignored():
    rows = f"++data.train.data_path={FIXTURES}/math.jsonl"
    loaded = load_nemo_rl_config(
        FIXTURES / "main" / "grpo_math_1B.yaml",
        [rows, "++policy.dtensor_cfg.env_vars={NCCL_DEBUG: INFO}", "++policy.megatron_cfg.env_vars={OTHER: x}"],
    )
    assert loaded.config.policy.env_vars == {"NCCL_DEBUG": "INFO"}  # megatron_cfg is off: NeMo-RL reads dtensor's
    megatron = load_nemo_rl_config(FIXTURES / "main" / "grpo_math_1B_megatron.yaml", [rows])
    assert megatron.config.policy.env_vars == {}  # its env_vars: null


def test_each_training_worker_process_has_the_variables(make_cluster, tiny_model_dir, tiny_tokenizer):
    import ray

    from rlcore.policy import Policy

    config = load_config_dict(
        {
            "cluster": {"workers_per_node": 2},
            "policy": {
                "backend": "reference",
                "model_name": tiny_model_dir,
                "train_global_batch_size": 2,
                "env_vars": {"POLICY_ENV_VARS_TEST": "one", "NCCL_DEBUG": "WARN"},
            },
        }
    ).policy
    policy = Policy(make_cluster(2), config, tiny_tokenizer, name_prefix="env-vars", init_reference_model=False)
    try:

        def read(_host, names):
            import os

            return {name: os.environ.get(name) for name in names}

        names = ("POLICY_ENV_VARS_TEST", "NCCL_DEBUG", "RANK")
        seen = ray.get([w.__ray_call__.remote(read, names) for w in policy.worker_group.workers])
        assert seen == [{"POLICY_ENV_VARS_TEST": "one", "NCCL_DEBUG": "WARN", "RANK": str(r)} for r in range(2)]
    finally:
        policy.shutdown()
