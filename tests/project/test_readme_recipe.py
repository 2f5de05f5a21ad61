"""The README's NeMo-RL recipe runs as written (issue 44, item 6: with NeMo-RL's chain-of-thought prompt the
prompt was 139 tokens against the recipe's context of 48, and the run failed).

Training it takes minutes on a CPU box, so its ``rlcore run`` is run here up to the start of Ray: everything a run
checks before Ray (the config, the model, the data with every prompt's length, the output directory) must pass,
and the run is handed to training. ``tests/project/test_docs.py`` runs the README's ``rlcore config validate``
line, which must carry the same arguments."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from tests.project.test_docs import logical_lines, parse_blocks

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"


def recipe(subcommand: str) -> list[str]:
    """The arguments of the README's ``rlcore <subcommand> --from nemo-rl ...`` command (one, exactly)."""
    found = [
        shlex.split(line, comments=True)[len(subcommand.split()) + 1 :]
        for block in parse_blocks(README)
        if block.kind == "commands"
        for line in logical_lines(block.text)
        if line.startswith(f"rlcore {subcommand} --from nemo-rl ")
    ]
    assert len(found) == 1, f"README.md: {len(found)} `rlcore {subcommand} --from nemo-rl` commands"
    return found[0]


def test_the_recipe_is_validated_with_the_arguments_it_runs_with() -> None:
    run = recipe("run")
    assert run == recipe("config validate")
    assert not [
        b for b in parse_blocks(README) if b.kind == "commands" and b.not_run is None and "rlcore run" in b.text
    ], "the run is marked not run; its validation is run"
    for path in [a.partition("=")[2] for a in run if a.partition("=")[2].startswith("tests/")] + [run[2]]:
        assert (REPO / path).is_file(), path


def run_until_ray(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, args: list[str]) -> tuple[Any, list]:
    """``rlcore run <args>`` from the repository root, its output directory in ``tmp_path``, training replaced
    by a stand-in that records what it was handed (Ray starts inside training)."""
    from rlcore.cli import run_cmd
    from rlcore.cli.app import app

    handed: list = []
    monkeypatch.setattr(run_cmd, "train", lambda resolved, **kwargs: handed.append(resolved) or {"steps": 0})
    monkeypatch.chdir(REPO)
    result = CliRunner().invoke(app, ["run", *args, "-o", f"logger.output_dir={tmp_path / 'run'}"])
    return result, handed


def test_the_recipe_passes_every_check_before_ray(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    result, handed = run_until_ray(monkeypatch, tmp_path, recipe("run"))
    assert result.exit_code == 0, result.output[-3000:]
    (resolved,) = handed
    cfg = resolved.config
    assert cfg.algorithm == "grpo" and cfg.policy.max_total_sequence_length == 256 and cfg.grpo.max_num_steps == 20
    assert Path(cfg.data.prompt_file).read_text() == (REPO / "tests/fixtures/nemo_rl/cot.txt").read_text()


def doc_recipes() -> list[tuple[str, list[str]]]:
    """Every ``rlcore run --from nemo-rl ...`` command of README.md and docs/*.md: (where, its arguments)."""
    found = []
    for page in [README, *sorted((REPO / "docs").glob("*.md"))]:
        for block in parse_blocks(page):
            if block.kind != "commands":
                continue
            for line in logical_lines(block.text):
                if line.startswith("rlcore run --from nemo-rl "):
                    found.append((page.name, shlex.split(line, comments=True)[2:]))
    return found


def test_every_recipe_of_the_docs_passes_every_check_before_ray(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """docs/getting-started.md kept the recipe with a context of 48 tokens after the README's was fixed."""
    recipes = doc_recipes()
    assert {where for where, _ in recipes} >= {"README.md", "getting-started.md"}
    for number, (where, args) in enumerate(recipes):
        result, handed = run_until_ray(monkeypatch, tmp_path / str(number), args)
        assert result.exit_code == 0 and len(handed) == 1, f"{where}: {' '.join(args)}\n{result.output[-2000:]}"


def test_the_recipe_s_old_context_is_refused_by_the_same_check(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """What the check above would meet with the recipe as it was: NeMo-RL's prompt does not fit in 48 tokens."""
    args = [a.replace("max_total_sequence_length=256", "max_total_sequence_length=48") for a in recipe("run")]
    result, handed = run_until_ray(monkeypatch, tmp_path, args)
    assert result.exit_code == 1 and not handed
    # NeMo-RL's max_input_seq_length (= the context) would cut and mask every prompt: nothing would be trained
    assert "tests/fixtures/nemo_rl/math.jsonl: every prompt checked (" in result.stderr
    assert "is at least data.max_input_seq_length=48 tokens" in result.stderr
