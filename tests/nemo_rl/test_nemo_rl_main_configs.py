"""Every GRPO, SFT, DPO and distillation example config of NeMo-RL's main loads or is refused with the fix.

The folder is walked as a whole (its commit: ``tests/fixtures/nemo_rl/main/COMMIT``), so a key a newer main
adds, copied in, fails here by name instead of surprising a user. Only the dataset is given locally.
"""

from __future__ import annotations

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
    "grpo_sliding_puzzle.yaml",
    "prorlv2.v2.yaml",
    "sft_openmathinstruct2.yaml",
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
    for line in problems:  # a refusal names the key and what to do
        key, _, why = line.partition(": ")
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
