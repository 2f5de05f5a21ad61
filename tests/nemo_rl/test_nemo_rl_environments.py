"""NeMo-RL's ``env.<name>`` sections name installed environments, plugins included (issue 44, 10).

The environments here are real registered ones (``python`` and ``regex`` come through the same
``rlcore_register_environments`` hook a third-party plugin uses).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rlcore.config import ConfigError, resolve
from rlcore.nemo_rl import load_nemo_rl_config

FIXTURES = Path(__file__).parents[1] / "fixtures" / "nemo_rl"
GRPO = FIXTURES / "v0.7.0" / "grpo_math_1B.yaml"
ROWS = FIXTURES / "math.jsonl"


def _load(*overrides: str):
    return load_nemo_rl_config(GRPO, [f"++data.train.data_path={ROWS}", "~env.math", *overrides])


def test_a_plugin_environment_section_selected_by_the_data_maps_to_that_environment_and_its_settings():
    loaded = _load("++data.train.env_name=regex", "++env.regex.pattern=\\d+", "++env.regex.num_workers=2")
    env = loaded.config.env
    assert (env.name, env.num_workers, env.backend_sections["regex_cfg"]) == ("regex", 2, {"pattern": "\\d+"})
    assert resolve(loaded.config, run=True).environment.section.pattern == "\\d+"
    assert not [line for line in loaded.ignored_lines() if line.startswith("ignored: env.regex")]


def test_without_an_env_name_the_first_installed_environment_section_is_the_run_s():
    loaded = _load("~data.default.env_name", "++env.python.reward=tests.fixtures.rewards:length_reward")
    assert loaded.config.env.name == "python"
    assert loaded.config.env.backend_sections["python_cfg"] == {"reward": "tests.fixtures.rewards:length_reward"}


def test_a_section_of_an_environment_not_installed_is_ignored_with_how_to_get_it():
    loaded = _load("++env.word_count.min_words=3", "++env.regex.pattern=x")
    lines = loaded.ignored_lines()
    assert any(
        line.startswith("ignored: env.word_count")
        and "no installed environment has this name" in line
        and "rlcore environments list" in line
        for line in lines
    ), lines
    assert any(line.startswith("ignored: env.regex") and "the run's environment is math" in line for line in lines)


def test_an_env_name_no_installed_environment_has_is_one_line_naming_the_nemo_rl_key():
    with pytest.raises(ConfigError) as caught:
        _load("++data.train.env_name=word_count")
    [line] = [line for line in caught.value.problems if "env_name" in line]
    assert line.startswith(
        "data.train.env_name: is 'word_count', and no installed environment has that name (installed: "
    ) and all(f"{name}," in line for name in ("exact_match", "math", "python")), line
    assert line.endswith(
        "; no plugin rlcore knows of provides 'word_count': choose an installed environment (rlcore environments "
        "list), or install or write the plugin that provides it (docs/tasks.md)"
    )


def test_a_typo_in_a_plugin_environment_section_names_the_key():
    loaded = _load("++data.train.env_name=regex", "++env.regex.patern=x")
    with pytest.raises(ConfigError) as caught:
        resolve(loaded.config, run=True)
    assert any(
        line.startswith("env.regex_cfg.patern: unknown key; did you mean 'pattern'?") for line in caught.value.problems
    ), caught.value.problems


def test_rlcore_config_validate_names_the_typo_under_the_key_the_user_wrote(tmp_path):
    """``++env.word_count.colum`` came back as ``env.word_count_cfg.colum`` alone: the line names both."""
    import subprocess
    import sys

    base = Path(__file__).resolve().parents[1] / "fixtures" / "nemo_rl" / "main" / "grpo_math_1B.yaml"
    proc = subprocess.run(
        [sys.executable, "-m", "rlcore", "config", "validate", "--from", "nemo-rl", "--no-files", str(base)]
        + ["++data.train.env_name=regex", "++env.regex.patern=x"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [line for line in proc.stderr.splitlines() if not line.startswith(("notice:", "ignored:"))]
    assert proc.returncode == 1
    assert "env.regex_cfg.patern (NeMo-RL: env.regex.patern): unknown key; did you mean 'pattern'?" in lines, lines


def test_an_env_name_of_an_installed_but_broken_plugin_is_named_broken_not_install_it(tmp_path):
    """NeMo-RL's ``env_name`` naming an installed plugin that fails to load said "install the plugin"."""
    import os
    import subprocess
    import sys

    from tests.preflight.test_preflight_run import write_plugin

    site = write_plugin(tmp_path / "site", "rl-word-count", "word_count", "import rlcore_no_such_dependency\n")
    base = Path(__file__).resolve().parents[1] / "fixtures" / "nemo_rl" / "main" / "grpo_math_1B.yaml"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [sys.executable, "-m", "rlcore", "config", "validate", "--from", "nemo-rl", "--no-files", str(base)]
        + ["++data.train.env_name=word_count"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    lines = [line for line in proc.stderr.splitlines() if not line.startswith(("notice:", "ignored:"))]
    assert proc.returncode == 1
    assert lines == [
        "data.train.env_name: is 'word_count', but environment 'word_count' is broken: plugin failed to "
        "load: ModuleNotFoundError: No module named 'rlcore_no_such_dependency' "
        f"(at {site / 'word_count' / '__init__.py'}:1); fix or reinstall rl-word-count (rlcore environments list "
        "shows it)"
    ], lines
