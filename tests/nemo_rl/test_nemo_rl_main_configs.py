"""Every GRPO, SFT, DPO and distillation example config of NeMo-RL's main loads or is refused with the fix.

The folder is walked as a whole (its commit: ``tests/fixtures/nemo_rl/main/COMMIT``), so a key a newer main
adds, copied in, fails here by name instead of surprising a user. Only the dataset is given locally.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rlcore.config import ConfigError
from rlcore.nemo_rl import load_nemo_rl_config, load_nemo_rl_dict

MAIN = Path(__file__).parents[1] / "fixtures" / "nemo_rl" / "main"
ROWS = Path(__file__).parents[1] / "fixtures" / "nemo_rl" / "math.jsonl"
CONFIGS = sorted(MAIN.glob("*.yaml"))
UNKNOWN = "a NeMo-RL key rlcore's reader does not know"
#: The configs that load with only a local dataset: a change that refuses one of them is a regression.
LOADS = {
    "grpo_math_1B.yaml",
    "grpo_math_8B.yaml",
    "grpo_math_1B_megatron.yaml",
    "grpo_math_8B_megatron.yaml",
    "grpo_math_70B_megatron.yaml",
    "grpo_math_8B_megatron_nixl.yaml",
    "prorlv2.v2.yaml",
    "sft_openmathinstruct2.yaml",
    "vlm_grpo_3B.yaml",
    "vlm_grpo_3B_megatron.yaml",
    "sft_vlm_3B.yaml",
}


def _problems(path: Path) -> list[str]:
    nemo = load_nemo_rl_dict(path)
    train = (nemo.get("data") or {}).get("train")
    local = [f"++data.train.data_path={ROWS}"] if isinstance(train, dict) else []
    try:
        load_nemo_rl_config(path, local)
    except ConfigError as exc:
        return exc.problems
    return []


def test_the_folder_holds_every_family_and_names_its_commit():
    names = {p.name for p in CONFIGS}
    assert {"grpo_math_1B.yaml", "sft.yaml", "dpo.yaml", "distillation_math.yaml"} <= names and len(names) >= 30
    assert "7ea279abfbeb698b092856d0dab61e7cf39bc909" in (MAIN / "COMMIT").read_text()


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_each_config_loads_or_is_refused_naming_the_fix(path):
    problems = _problems(path)
    unknown = [line for line in problems if UNKNOWN in line]
    assert not unknown, (
        f"{path.name}: keys rlcore's reader does not know (map them, ignore them with a reason, "
        "or refuse them with the fix in rlcore/nemo_rl/table.py):\n" + "\n".join(unknown)
    )
    if path.name in LOADS:
        assert problems == []
    for line in problems:  # a refusal names the key (and the NeMo-RL key it came from) and what to do
        key, _, why = re.sub(r" \(NeMo-RL: [^)]*\)", "", line, count=1).partition(": ")
        assert key and " " not in key and why, line
        assert any(word in why for word in ("set ", "remove", "give", "install", "use ", "keeps", "make ", "++")), line


def test_a_negative_val_period_is_no_periodic_validation_as_in_nemo_rl():
    """grpo_smoke.yaml says val_period: -1; NeMo-RL validates when the period is > 0. Its checkpointing is off,
    so the checkpoint metric it inherits ranks nothing and the file loads as written."""
    assert _problems(MAIN / "grpo_smoke.yaml") == []
    loaded = load_nemo_rl_config(MAIN / "grpo_smoke.yaml", [f"++data.train.data_path={ROWS}"])
    assert (loaded.config.grpo.val_period, loaded.config.checkpointing.enabled) == (0, False)


def test_a_checkpoint_metric_never_measured_is_refused_only_when_checkpoints_are_saved():
    with pytest.raises(ConfigError) as caught:
        load_nemo_rl_config(MAIN / "grpo_smoke.yaml", [f"++data.train.data_path={ROWS}", "checkpointing.enabled=true"])
    [line] = caught.value.problems
    assert line.startswith(
        "checkpointing.metric_name: validation/accuracy is never measured, as grpo.val_period is "
        "0 (no periodic validation); set grpo.val_period to a divisor of "
    )


def test_a_recipe_whose_environment_is_its_task_is_refused_not_swapped_for_math():
    """grpo_sliding_puzzle.yaml inherits grpo_math_1B's math data; its own script makes sliding puzzles instead.
    It validated and then trained OpenMathInstruct-2 with 50 turns, its env section one ``ignored:`` line."""
    problems = _problems(MAIN / "grpo_sliding_puzzle.yaml")
    assert problems == [
        "env.sliding_puzzle_game: is NeMo-RL's sliding-puzzle game (its script, examples/run_grpo_sliding_puzzle.py, "
        "generates the puzzles and scores each move over up to grpo.max_rollout_turns turns; data.* is not read), a "
        "task rlcore has no environment for (installed: agent, digits, exact_match, guessing, math, python, "
        "regex, reward_model, tools, verifiers, vlm); install a plugin that registers 'sliding_puzzle_game' to run "
        "this recipe, or remove the section to train the math task its data names"
    ]
    without = load_nemo_rl_config(
        MAIN / "grpo_sliding_puzzle.yaml", [f"++data.train.data_path={ROWS}", "~env.sliding_puzzle_game"]
    )
    assert without.config.env.name == "math"  # the fix the line gives: the math task, as the user then chose
