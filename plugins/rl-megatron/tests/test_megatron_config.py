"""Settings the megatron backend cannot run here, or that would change what a training step means.

Each is a config error naming the dotted path (rl_megatron.config); through a
``Policy`` the worker refuses to start with that message.
"""

from __future__ import annotations

from typing import Any

import pytest
from megatron_helpers import model_dir, policy_config

from rl_megatron.config import megatron_config_problems

pytest_plugins = ["rlcore.testing.pytest_plugin"]
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _problems(cuda: bool = False, te: bool = False, world: int = 2, **policy: Any) -> list[str]:
    return megatron_config_problems(policy_config("unused", world, **policy), cuda=cuda, transformer_engine=te)


def test_the_default_settings_are_fine_on_cpu() -> None:
    assert _problems() == []


def test_transformer_engine_features_are_config_errors_on_cpu() -> None:
    (problem,) = _problems(sequence_packing={"enabled": True})
    assert problem.startswith("policy.sequence_packing.enabled: ") and "TransformerEngine" in problem
    assert "no CUDA GPU" in problem


@pytest.mark.parametrize("cuda", [False, True], ids=["cpu-checks", "cuda-checks"])
def test_sequence_parallel_accepts_any_divisor_and_pads_to_a_multiple_of_tp(cuda: bool) -> None:
    """NeMo-RL's SP recipes set make_sequence_length_divisible_by 1: the worker pads to lcm(divisor, tp) itself."""
    from rl_megatron.pipeline import width_multiple

    sp = {"sequence_parallel": True, "tensor_model_parallel_size": 2}
    for divisor in (1, 3, 4):
        assert _problems(cuda=cuda, te=cuda, megatron=sp, make_sequence_length_divisible_by=divisor) == []
    assert [width_multiple(d, 2, True) for d in (1, 3, 4)] == [2, 6, 4]
    assert width_multiple(3, 2, False) == 3  # without sequence parallelism the divisor alone


def test_context_parallel_is_accepted_on_cpu_with_pipeline_stages_and_experts() -> None:
    """CP runs on the local spec, CPU and GPU alike (test_megatron_context_parallel.py), with pipeline stages
    (the same file, CP 2 x PP 2) and for a model with experts (test_megatron_moe.py, CP 2: the routers' logits are
    gathered over CP for the aux loss)."""
    from test_megatron_moe import moe_model

    from rl_megatron.config import megatron_section, moe_model_problems
    from rlcore.config import resolve_policy

    config = policy_config(model_dir("llama"), 2, megatron={"context_parallel_size": 2})
    for use_gpu in (False, True):
        resolve_policy(config, world_size=2, use_gpu=use_gpu)
    with_pp = policy_config(
        model_dir("llama"), 4, megatron={"context_parallel_size": 2, "pipeline_model_parallel_size": 2}
    )
    resolve_policy(with_pp, world_size=4, use_gpu=False)
    moe = megatron_section(policy_config(moe_model(), 2, megatron={"context_parallel_size": 2}))
    assert moe_model_problems(moe, moe_model(), world_size=2) == []


def test_bf16_and_the_distributed_optimizer_are_accepted_on_cpu() -> None:
    """NeMo-RL's standard mixed precision (bf16 model, fp32 main weights) with the distributed optimizer runs
    on CPU too (cpu_compat; test_megatron_mixed_precision.py trains it)."""
    standard = {"optimizer": "adam", "bf16": True, "params_dtype": "float32", "use_distributed_optimizer": True}
    assert _problems(precision="bfloat16", megatron={"optimizer": standard}) == []


def test_the_precision_aware_optimizer_with_fp32_state_runs_as_the_distributed_one_without_te() -> None:
    """NeMo-RL's megatron recipes set use_precision_aware_optimizer with float32 main weights: the same state
    and update as the plain distributed optimizer, which runs without TransformerEngine's FusedAdam; on CPU it is
    accepted with one ignored line (low-precision state stays refused: the case above)."""
    aware = {
        "optimizer": "adam",
        "bf16": True,
        "params_dtype": "float32",
        "use_distributed_optimizer": True,
        "use_precision_aware_optimizer": True,
    }
    with pytest.warns(UserWarning, match=r"^ignored: policy\.megatron_cfg\.optimizer\.use_precision_aware_optimizer"):
        assert _problems(precision="bfloat16", megatron={"optimizer": aware}) == []


@pytest.mark.parametrize(
    "optimizer, path, fix",
    [
        (
            {
                "optimizer": "adam",
                "bf16": True,
                "params_dtype": "bfloat16",
                "use_distributed_optimizer": True,
                "use_precision_aware_optimizer": True,
            },
            "policy.megatron_cfg.optimizer.use_precision_aware_optimizer",
            "TransformerEngine's FusedAdam",
        ),
        (
            {"optimizer": "sgd", "use_distributed_optimizer": True},
            "policy.megatron_cfg.optimizer.use_distributed_optimizer",
            "use optimizer 'adam'",
        ),
    ],
)
def test_optimizers_megatron_cannot_run_here_are_config_errors(optimizer: dict, path: str, fix: str) -> None:
    precision = "bfloat16" if optimizer.get("bf16") else "float32"
    (problem,) = _problems(precision=precision, megatron={"optimizer": optimizer})
    assert problem.startswith(f"{path}: ") and fix in problem, problem


@pytest.mark.parametrize(
    "megatron, path",
    [
        (
            {"distributed_data_parallel_config": {"average_in_collective": True}},
            "policy.megatron_cfg.distributed_data_parallel_config.average_in_collective",
        ),
        ({"optimizer": {"bf16": True}}, "policy.megatron_cfg.optimizer.bf16"),
        ({"optimizer": {"params_dtype": "bfloat16"}}, "policy.megatron_cfg.optimizer.params_dtype"),
        ({"scheduler": {"lr_decay_style": "cosine"}}, "policy.megatron_cfg.scheduler.lr_decay_iters"),
    ],
)
def test_settings_that_change_the_step_are_config_errors(megatron: dict, path: str) -> None:
    problems = _problems(cuda=True, te=True, megatron=megatron)
    assert any(p.startswith(f"{path}: ") for p in problems), problems


def test_fp32_main_weights_are_the_standard_mixed_precision() -> None:
    """NeMo-RL's megatron configs: a bf16 model with fp32 main weights (params_dtype float32)."""
    standard = {"bf16": True, "params_dtype": "float32"}
    assert _problems(cuda=True, te=True, precision="bfloat16", megatron={"optimizer": standard}) == []
    low = {"bf16": True, "params_dtype": "bfloat16"}
    (problem,) = _problems(cuda=True, te=True, precision="bfloat16", megatron={"optimizer": low})
    assert problem.startswith("policy.megatron_cfg.optimizer.params_dtype: ") and "precision_aware" in problem
    aware = {**low, "optimizer": "adam", "use_distributed_optimizer": True, "use_precision_aware_optimizer": True}
    assert _problems(cuda=True, te=True, precision="bfloat16", megatron={"optimizer": aware}) == []


def test_policy_refuses_to_start_with_the_dotted_path(make_cluster: Any, tiny_tokenizer: Any) -> None:
    """megatron's config check runs when the Policy resolves its config: before any worker starts."""
    from rlcore.config import ConfigError
    from rlcore.policy import Policy

    config = policy_config(model_dir("llama"), 2, sequence_packing={"enabled": True})  # needs TransformerEngine
    cluster = make_cluster(2)
    with pytest.raises(ConfigError, match=r"^policy\.sequence_packing\.enabled: "):
        Policy(cluster, config, tiny_tokenizer, name_prefix="megatron-packing-on-cpu")
    assert cluster._placement_group is None  # nothing was reserved, nothing started


def test_tensor_parallel_size_must_divide_the_kv_heads(
    make_cluster: Any, tiny_tokenizer: Any, tiny_model_dir: str
) -> None:
    from rlcore.distributed import WorkerError
    from rlcore.policy import Policy

    config = policy_config(tiny_model_dir, 2, megatron={"tensor_model_parallel_size": 2})  # 1 KV head
    with pytest.raises(
        WorkerError,
        match=r"tensor_model_parallel_size: 2 does not divide the model's "
        r"num_key_value_heads \(1\)",
    ):
        Policy(make_cluster(2), config, tiny_tokenizer, name_prefix="megatron-tp-too-large")


def test_logprobs_take_the_chunked_path_when_asked():
    """``rl_megatron.vocab_parallel.token_logprobs`` (what the worker calls with ``policy.logprob_chunk_size``),
    on one rank's whole vocabulary with padded columns beyond the model's vocabulary; the tensor-parallel run
    is test_megatron_parallel.py's ``tp2-chunked`` layout."""
    import torch

    from rl_megatron.vocab_parallel import token_logprobs

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 8, 32, generator=gen, requires_grad=True)  # 32 columns, a vocabulary of 29
    ids = torch.randint(0, 29, (2, 8), generator=gen)
    lp = token_logprobs(logits, ids, 0, 29, None, temperature=0.7, chunk_size=3)
    expected = (logits[:, :-1, :29].double() / 0.7).log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    assert type(lp.grad_fn.next_functions[0][0]).__name__ == "ChunkedLogprobBackward"  # under the [:, :-1]
    assert (lp.double() - expected).abs().max() < 1e-5
