"""NeMo-RL's single-controller asynchronous loop (``async_rl`` with ``data_plane.enabled``) read as rlcore's
asynchronous GRPO with in-flight weight updates, and NeMo-RL's in-flight keys of ``grpo.async_grpo``.

References (NeMo-RL at the fixtures' commit): the in_order sampler dispatches batch ``s`` once the trainer holds
``v(s - max_lookahead_versions)`` and trains it at step ``s`` (nemo_rl/algorithms/async_utils/staleness_sampler.py:
``_GatedSampler.admit``, ``InOrderSampler.select``); a weight sync never drains the requests running
(nemo_rl/algorithms/single_controller.py: ``_sync_weights``); the entry point refuses a ``grpo.async_grpo`` block
(examples/run_grpo_single_controller.py); the buffer-capacity and resiliency rules are
nemo_rl/algorithms/single_controller_utils/config.py's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from rlcore.cli.app import app
from rlcore.nemo_rl import convert_file
from rlcore.nemo_rl.conversion import Conversion
from rlcore.nemo_rl.convert import convert
from rlcore.nemo_rl.loader import load_nemo_rl_dict

MAIN = Path(__file__).parents[1] / "fixtures" / "nemo_rl" / "main"
SC = MAIN / "grpo_math_1B_megatron_single_controller.yaml"
GRPO = MAIN / "grpo_math_1B.yaml"
IS_ON = "loss_fn.use_importance_sampling_correction=true"
runner = CliRunner()


def conversion(*overrides: str, path: Path = SC) -> Conversion:
    return convert(load_nemo_rl_dict(path, list(overrides)))


def the_sc_file() -> Conversion:
    return conversion()


def test_the_single_controller_recipe_is_asynchronous_grpo_with_in_flight_updates_on_the_async_engine():
    out = the_sc_file()
    assert out.problems == []
    assert out.config["grpo"]["async_grpo"] == {
        "enabled": True,
        "max_trajectory_age_steps": 1,  # async_rl.sampler.max_lookahead_versions
        "in_flight_weight_updates": True,
        "recompute_kv_cache_after_weight_updates": False,
    }
    assert out.config["policy"]["generation"]["vllm_cfg"]["async_engine"] is True
    assert out.sources["grpo.async_grpo.max_trajectory_age_steps"] == "async_rl.sampler"
    assert out.sources["grpo.async_grpo.recompute_kv_cache_after_weight_updates"] == (
        "async_rl.recompute_kv_cache_after_weight_updates"
    )
    ignored = dict(out.ignored)
    for key in ("min_groups_for_streaming_train", "max_inflight_prompts", "diagnostics", "max_buffered_rollouts"):
        assert ignored[f"async_rl.{key}"]  # each with its reason
    assert "one optimizer step on all of the step's groups" in ignored["async_rl.min_groups_for_streaming_train"]
    assert "parity-tested" in ignored["data_plane"]
    # NeMo-RL's SC trains without importance weights here (its in_order sampler does not require them): the
    # recipe validates as written (the --no-files check of a GPU config), and so it does with them set.
    for extra in ((), (IS_ON,)):
        result = runner.invoke(app, ["config", "validate", "--no-files", "--from", "nemo-rl", str(SC), *extra])
        assert result.exit_code == 0 and result.stdout.startswith(f"OK: {SC}"), result.output


def test_the_in_order_lookahead_is_the_age_limit_and_zero_is_synchronous():
    lookahead_3 = ("async_rl.sampler.max_lookahead_versions=3", "async_rl.recompute_kv_cache_after_weight_updates=true")
    out = conversion(*lookahead_3)  # 4 batches of 32 groups to buffer, above the recipe's 64: NeMo-RL refuses it too
    assert out.problems == [
        "async_rl.max_buffered_rollouts: is 64, below the in_order sampler's capacity grpo.num_prompts_per_step × "
        "(max_lookahead_versions + 1) = 128, which NeMo-RL refuses (its rollout pump would deadlock); raise it to "
        "at least that"
    ]
    out = conversion(*lookahead_3, "async_rl.max_buffered_rollouts=128")
    assert out.problems == []
    a = out.config["grpo"]["async_grpo"]
    assert (a["max_trajectory_age_steps"], a["recompute_kv_cache_after_weight_updates"]) == (3, True)
    out = conversion("async_rl.sampler.max_lookahead_versions=0")
    assert out.problems == [] and "async_grpo" not in out.config["grpo"]
    assert "synchronous GRPO" in dict(out.ignored)["async_rl.sampler.max_lookahead_versions"]


@pytest.mark.parametrize("sampler", ["weight_fifo", "windowed", "ready_first"])
def test_samplers_that_train_on_whatever_is_ready_are_refused(sampler):
    out = conversion(f"async_rl.sampler.name={sampler}", "++async_rl.sampler.max_staleness_versions=1")
    assert len(out.problems) == 1, out.problems
    assert out.problems[0].startswith(f"async_rl.sampler.name: is '{sampler}', which ")
    assert out.problems[0].endswith("set async_rl.sampler.name: in_order with max_lookahead_versions")
    assert "async_grpo" not in out.config["grpo"]


def test_a_buffer_below_the_sampler_capacity_is_refused():
    # capacity = num_prompts_per_step (32) × (lookahead 1 + 1) = 64, the recipe's value: accepted above.
    out = conversion("async_rl.max_buffered_rollouts=63")
    assert out.problems == [
        "async_rl.max_buffered_rollouts: is 63, below the in_order sampler's capacity grpo.num_prompts_per_step × "
        "(max_lookahead_versions + 1) = 64, which NeMo-RL refuses (its rollout pump would deadlock); raise it to "
        "at least that"
    ]


def test_rollout_failure_is_refused_where_it_drops_prompts_or_sets_a_deadline():
    out = conversion("async_rl.rollout_failure.max_skipped_prompts=2")
    assert len(out.problems) == 1 and out.problems[0].startswith(
        "async_rl.rollout_failure.max_skipped_prompts, async_rl.rollout_failure.max_consecutive_dropped_prompts: "
        "are 2, 0, so a prompt"
    )
    out = conversion("async_rl.rollout_failure.native.generation_timeout_s=120")
    assert len(out.problems) == 1 and out.problems[0].startswith(
        "async_rl.rollout_failure.native.generation_timeout_s: is 120, a deadline"
    )
    assert "no prompt may be dropped" in dict(the_sc_file().ignored)["async_rl.rollout_failure"]


def test_the_stall_watchdog_only_reports_unless_it_aborts():
    out = conversion("async_rl.stall_watchdog.stall_action=abort")
    assert len(out.problems) == 1 and out.problems[0].startswith("async_rl.stall_watchdog.stall_action: is 'abort'")
    assert "prints a warning" in dict(the_sc_file().ignored)["async_rl.stall_watchdog"]


@pytest.mark.parametrize("block", ["generation_fleet_health", "generation_router"])
def test_fleet_health_and_the_router_are_ignored_off_and_refused_on(block):
    assert dict(the_sc_file().ignored)[f"async_rl.{block}"] == "off"
    out = conversion(f"async_rl.{block}.enabled=true")
    assert len(out.problems) == 1 and out.problems[0].startswith(f"async_rl.{block}.enabled: is true: NeMo-RL then")
    assert out.problems[0].endswith("; set it to false")


def test_keys_nemo_rl_does_not_know_and_a_legacy_async_block_are_refused():
    out = conversion("++async_rl.watchdog.interval_s=5")  # NeMo-RL's old name: it refuses it too
    assert len(out.problems) == 1 and out.problems[0].startswith("async_rl.watchdog: is ")
    assert "a NeMo-RL key rlcore's reader does not know" in out.problems[0]
    out = conversion("++grpo.async_grpo.enabled=false")
    assert any(
        line.startswith("grpo.async_grpo: is set, but NeMo-RL's single-controller loop") for line in out.problems
    )
    out = conversion("data_plane.enabled=false")  # no script of NeMo-RL reads async_rl then
    assert out.problems == [] and "refuses to start without data_plane.enabled" in dict(out.ignored)["async_rl"]


def test_nemo_rl_s_in_flight_keys_map_as_they_are():
    out = convert_file(
        GRPO,
        [
            "grpo.async_grpo.enabled=true",
            "grpo.async_grpo.in_flight_weight_updates=true",
            "grpo.async_grpo.recompute_kv_cache_after_weight_updates=true",
            "policy.generation.vllm_cfg.async_engine=true",
            "++data.train.data_path=" + str(MAIN.parent / "math.jsonl"),
        ],
    )
    a = out.config["grpo"]["async_grpo"]
    assert (a["in_flight_weight_updates"], a["recompute_kv_cache_after_weight_updates"]) == (True, True)
    assert out.config["policy"]["generation"]["vllm_cfg"]["async_engine"] is True
    assert out.sources["grpo.async_grpo.in_flight_weight_updates"] == "grpo.async_grpo.in_flight_weight_updates"


def test_the_legacy_recompute_key_maps_with_in_flight_updates_and_is_ignored_without() -> None:
    """NeMo-RL's ``grpo.async_grpo.recompute_kv_cache_after_weight_updates`` (grpo_math_1B_dynamo.yaml sets it
    without in-flight updates): as it is with them; without them one ``ignored`` line, since nothing computed on
    older weights outlives a refit there (rlcore's own config refuses the pair)."""
    key = "grpo.async_grpo.recompute_kv_cache_after_weight_updates"
    on = ("grpo.async_grpo.enabled=true", f"{key}=true")
    with_in_flight = conversion(*on, "grpo.async_grpo.in_flight_weight_updates=true", path=MAIN / "grpo_math_1B.yaml")
    assert with_in_flight.problems == []
    assert with_in_flight.config["grpo"]["async_grpo"]["recompute_kv_cache_after_weight_updates"] is True
    without = conversion(*on, path=MAIN / "grpo_math_1B.yaml")
    assert without.problems == []
    assert "recompute_kv_cache_after_weight_updates" not in without.config["grpo"]["async_grpo"]
    assert "no request runs across a refit" in dict(without.ignored)[key]
