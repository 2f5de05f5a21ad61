"""An algorithm is one package: the config layer knows its sections only through the registry.

An algorithm registered in this process whose config class is a plain ``pydantic.BaseModel`` (deriving from
nothing of rlcore's) validates, is skipped by the core's rules that read a loop's schedule, and still has its own
problems reported with their dotted paths; the top-level sections an algorithm owns (``AlgorithmSpec.sections``,
GRPO's ``loss``) are validated and read like fields; its rules (``AlgorithmSpec.rules``) run through the registry.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Iterator

import pytest
from pydantic import BaseModel, Field

from rlcore.config import ConfigError, RLCoreConfig, check_rules, load_config_dict
from rlcore.config.offline_loop import OfflineLoopConfig
from rlcore.config.rollout_loop import RolloutLoopConfig
from rlcore.config.schedule import LoopSchedule, schedule_of


class PlainRFT(BaseModel):
    """Rejection-sampling fine-tuning's section, written without rlcore's base classes."""

    steps: int = Field(2, gt=0)
    keep_above: float = 0.5


class RFTFilterConfig(BaseModel):
    """A top-level section the plain algorithm owns besides its own."""

    min_reward: float = 0.0
    max_kept: int = Field(8, gt=0)


def plain_rft_rules(cfg: RLCoreConfig) -> Iterator[str]:
    """The plain algorithm's own cross-field rule: what it keeps must pass its filter."""
    section, kept = cfg.plain_rft, cfg.rft_filter
    if section is not None and section.keep_above < kept.min_reward:
        yield (
            f"plain_rft.keep_above: {section.keep_above} is below rft_filter.min_reward {kept.min_reward}; "
            "raise it or lower the filter"
        )


@pytest.fixture
def plain_rft(monkeypatch):
    """This process's registry with the installed algorithms plus ``plain_rft``, from this module."""
    from rlcore.plugins import AlgorithmSpec, Registry, hookimpl
    from rlcore.testing.pytest_plugin import isolated_registry

    here = __name__

    class PlainRFTPlugin:
        @staticmethod
        @hookimpl
        def rlcore_register_algorithms(register):
            register(
                AlgorithmSpec(
                    name="plain_rft",
                    config_class=f"{here}:PlainRFT",
                    algorithm_class="rlcore.interfaces.algorithm:Algorithm",
                    generates=True,
                    sections={"rft_filter": f"{here}:RFTFilterConfig"},
                    rules=f"{here}:plain_rft_rules",
                )
            )

    monkeypatch.setattr("rlcore.config.schemas._INSTALLED", [])
    registry = Registry()
    registry.load_entry_points()
    registry.register_plugin(PlainRFTPlugin, name="plain_rft")
    with isolated_registry(registry):
        yield registry


def test_a_plain_config_class_validates_and_the_schedule_rules_skip_it(plain_rft):
    # checkpointing.metric_name would need <algorithm>.val_period; validation data would need val_* settings
    cfg = load_config_dict(
        {"plain_rft": {"steps": 3}, "checkpointing": {"metric_name": "validation/accuracy"}, "env": {"name": "digits"}}
    )
    assert cfg.algorithm == "plain_rft" and cfg.plain_rft == PlainRFT(steps=3)
    assert schedule_of(cfg.algorithm_section) is None
    assert check_rules(cfg) == []
    assert cfg.rft_filter == RFTFilterConfig()  # an owned section left out reads as its defaults


def test_a_rollout_section_still_gets_the_schedule_rules(plain_rft):
    """The same config with GRPO's section: the rule that the skip above left out finds the problem."""
    with pytest.raises(ConfigError, match=r"checkpointing.metric_name: validation/accuracy is never measured"):
        load_config_dict({"grpo": {}, "checkpointing": {"metric_name": "validation/accuracy"}})


def test_a_plain_sections_problems_keep_their_dotted_paths(plain_rft):
    with pytest.raises(ConfigError) as caught:
        load_config_dict({"plain_rft": {"steps": 0}, "rft_filter": {"max_kept": "many"}})
    assert caught.value.problems == [
        "plain_rft.steps: expected a value > 0, got 0",
        "rft_filter.max_kept: expected an integer, got 'many'",
    ]
    # a plain model ignores unknown keys; the config layer still refuses them, with the closest name
    with pytest.raises(ConfigError, match=r"plain_rft.keep_abov: unknown key; did you mean 'keep_above'\?"):
        load_config_dict({"plain_rft": {"keep_abov": 1.0}})


def test_an_algorithms_own_rules_run_through_the_registry(plain_rft):
    with pytest.raises(ConfigError, match=r"plain_rft.keep_above: 0.5 is below rft_filter.min_reward 0.9"):
        load_config_dict({"plain_rft": {}, "rft_filter": {"min_reward": 0.9}})
    # its rules do not judge a config that trains another algorithm and leaves its sections out
    assert check_rules(load_config_dict({"grpo": {}})) == []


def test_an_owned_section_round_trips_and_is_written_only_when_given(plain_rft):
    given = load_config_dict({"plain_rft": {}, "rft_filter": {"max_kept": 4}})
    assert given.model_dump()["rft_filter"] == {"min_reward": 0.0, "max_kept": 4}
    assert load_config_dict(given.model_dump()) == given
    assert "rft_filter" not in load_config_dict({"plain_rft": {}}).model_dump()
    with pytest.raises(ConfigError, match=r"rft_fliter: unknown key; did you mean 'rft_filter'\?"):
        load_config_dict({"plain_rft": {}, "rft_fliter": {}})


def test_the_loss_section_is_grpos_and_reads_as_before():
    from rlcore.algorithms.grpo.loss_config import ClippedPGLossConfig

    cfg = load_config_dict({"loss": {"ratio_clip_min": 0.1}})
    assert isinstance(cfg.loss, ClippedPGLossConfig) and cfg.loss.ratio_clip_min == 0.1
    assert load_config_dict({}).loss == ClippedPGLossConfig()
    with pytest.raises(ConfigError, match=r"loss.ratio_clip_mn: unknown key; did you mean 'ratio_clip_min'\?"):
        load_config_dict({"loss": {"ratio_clip_mn": 0.1}})
    # GRPO's rules judge the loss: KL in the reward needs a Reinforce++ estimator
    with pytest.raises(ConfigError, match=r"loss.use_kl_in_reward: only the Reinforce\+\+ advantages"):
        load_config_dict({"grpo": {}, "loss": {"use_kl_in_reward": True, "reference_policy_kl_penalty": 0.1}})


def test_rlcores_loop_sections_implement_the_schedule():
    from rlcore.algorithms.distillation.config import DistillationConfig
    from rlcore.algorithms.dpo.config import DPOConfig
    from rlcore.algorithms.grpo.config import GRPOConfig
    from rlcore.algorithms.sft.config import SFTConfig

    for section in (GRPOConfig(), DistillationConfig(teacher_model_name="tiny-llama"), SFTConfig(), DPOConfig()):
        assert isinstance(section, LoopSchedule), type(section).__name__
    assert issubclass(GRPOConfig, RolloutLoopConfig) and issubclass(SFTConfig, OfflineLoopConfig)
    assert not isinstance(PlainRFT(), LoopSchedule)


def test_the_base_algorithm_reads_nothing_of_grpos():
    from rlcore.algorithms.grpo.loop import GRPO
    from rlcore.interfaces.algorithm import Algorithm

    kl = load_config_dict({"grpo": {}, "loss": {"reference_policy_kl_penalty": 0.1}})
    assert Algorithm("plain").needs_reference_model(PlainRFT()) is False  # no cfg.loss read
    assert GRPO("grpo").needs_reference_model(kl) is True
    assert GRPO("grpo").needs_reference_model(load_config_dict({})) is False


OLD_PATHS = [
    ("rlcore.config.grpo", "GRPOConfig", "rlcore.algorithms.grpo.config"),
    ("rlcore.config.grpo", "RewardShapingConfig", "rlcore.algorithms.grpo.config"),
    ("rlcore.config.grpo", "CheckpointingConfig", "rlcore.config.checkpointing"),
    ("rlcore.config.loss", "ClippedPGLossConfig", "rlcore.algorithms.grpo.loss_config"),
    ("rlcore.config.sft", "SFTConfig", "rlcore.algorithms.sft.config"),
    ("rlcore.config.sft", "OfflineLoopConfig", "rlcore.config.offline_loop"),
    ("rlcore.config.dpo", "DPOLossConfig", "rlcore.algorithms.dpo.config"),
    ("rlcore.config.distillation", "DistillationLossConfig", "rlcore.algorithms.distillation.config"),
    ("rlcore.algorithms.advantages", "group_advantages", "rlcore.algorithms.grpo.advantages"),
    ("rlcore.algorithms.reward_transforms", "transform_rewards", "rlcore.algorithms.grpo.reward_transforms"),
    ("rlcore.algorithms.preference", "DPOLossFn", "rlcore.algorithms.dpo.loss"),
]


@pytest.mark.parametrize(("old", "name", "new"), OLD_PATHS, ids=[f"{o}.{n}" for o, n, _ in OLD_PATHS])
def test_a_moved_module_keeps_its_old_path_for_a_release_and_warns(old, name, new, monkeypatch):
    monkeypatch.delitem(sys.modules, old, raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    assert any(issubclass(w.category, DeprecationWarning) and old in str(w.message) for w in caught)
    assert getattr(module, name) is getattr(importlib.import_module(new), name)


def test_rlcore_config_still_exports_the_algorithm_classes_it_did():
    import rlcore.config as config
    from rlcore.algorithms.grpo.config import GRPOConfig
    from rlcore.algorithms.sft.config import SFTConfig

    assert (config.GRPOConfig, config.SFTConfig) == (GRPOConfig, SFTConfig)
    with pytest.raises(AttributeError):
        config.NoSuchConfig  # noqa: B018
