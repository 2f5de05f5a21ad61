"""The example configs ship with the package: each one runs with `rlcore run` or says how it is used,
`rlcore examples list|copy` work, `rlcore run` alone runs grpo_tiny, and the checkout's examples/ holds
links to the shipped files (one copy of each)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rlcore.config import load_config, resolve
from rlcore.config.schemas import registered_algorithms
from rlcore.examples import DEFAULT_EXAMPLE, example_names, example_path, example_summary

ROOT = Path(__file__).resolve().parents[2]


def rlcore(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlcore", *args], capture_output=True, text=True, timeout=120, cwd=cwd)


@pytest.mark.parametrize("name", example_names())
def test_every_example_runs_with_rlcore_run_or_says_how_it_is_used(name):
    header = "\n".join(line for line in example_path(name).read_text().splitlines() if line.startswith("#"))
    assert example_summary(name) and "rlcore run" in header, header
    cfg = load_config(example_path(name))
    if not registered_algorithms()[cfg.algorithm].generates:  # trains on the data as written (sft, dpo, rm)
        assert resolve(cfg, run=True).generation is None
        return
    if cfg.policy.generation is None:  # a training layout: its header gives the override that makes it a run
        override = f"rlcore run {name} -o policy.generation.backend=vllm"
        assert override in " ".join(header.replace("#", " ").split()), header
        cfg = load_config(example_path(name), ["policy.generation.backend=vllm"])
    assert resolve(cfg, run=True).generation is not None  # what rlcore run resolves, before anything starts


def test_checkout_examples_are_links_to_the_shipped_files():
    checkout = {p.stem: p for p in (ROOT / "examples").glob("*.yaml")}
    assert sorted(checkout) == example_names()
    for name, link in checkout.items():
        assert link.is_symlink() and link.resolve() == example_path(name).resolve(), link


def test_examples_list_and_copy(tmp_path):
    listed = rlcore("examples", "list").stdout.splitlines()
    assert [line.split()[0] for line in listed] == example_names()
    assert any(line.startswith(DEFAULT_EXAMPLE) and "without a config" in line for line in listed)

    copied = rlcore("examples", "copy", "grpo_megatron", cwd=tmp_path)
    assert copied.returncode == 0, copied.stderr
    assert (tmp_path / "grpo_megatron.yaml").read_text() == example_path("grpo_megatron").read_text()
    (tmp_path / "grpo_megatron.yaml").write_text("# mine\n")
    again = rlcore("examples", "copy", "grpo_megatron", cwd=tmp_path)
    assert again.returncode == 1 and "--force" in again.stderr
    assert (tmp_path / "grpo_megatron.yaml").read_text() == "# mine\n"  # nothing lost
    math = rlcore("examples", "copy", "grpo_math_tiny", cwd=tmp_path)  # trains and validates on one file
    assert math.stdout.strip() == (
        "wrote grpo_math_tiny.yaml and data/arithmetic.jsonl; run it with: rlcore run grpo_math_tiny.yaml"
    )
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["arithmetic.jsonl"]
    unknown = rlcore("examples", "copy", "grpo_tinny", cwd=tmp_path)
    assert unknown.returncode == 1 and "grpo_tiny" in unknown.stderr and len(unknown.stderr.splitlines()) == 1


def test_rlcore_run_without_a_config_is_grpo_tiny(tmp_path):
    """Checked through an error that quotes grpo_tiny's own batch sizes (nothing starts)."""
    out = rlcore("run", "-o", "cluster.workers_per_node=3", cwd=tmp_path)
    named = rlcore("run", "grpo_tiny", "-o", "cluster.workers_per_node=3", cwd=tmp_path)
    assert out.returncode == named.returncode == 1
    assert out.stderr == named.stderr and "train_global_batch_size: 32" in out.stderr, out.stderr
    assert not (tmp_path / "runs").exists()
