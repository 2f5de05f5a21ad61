"""The ``vlm`` environment scores as NeMo-RL's VLM environment does (nemo_rl/environments/rewards.py, main 7ea279a):
each check against rewards computed by hand, the weighted sum, and its components."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rlcore.environments.vlm_rewards import (
    VlmRewardsConfig,
    VlmRewardsEnvironment,
    bbox_giou_reward,
    exact_alnum_reward,
    format_reward,
    geo3k_reward,
    math_expr_reward,
)


def env(*functions: dict) -> VlmRewardsEnvironment:
    return VlmRewardsEnvironment(VlmRewardsConfig.model_validate({"reward_functions": list(functions)}))


def log(*completions: str) -> list[dict]:
    return [{"role": "user", "content": "How many cubes?"}, *({"role": "assistant", "content": c} for c in completions)]


@pytest.mark.parametrize(
    ("response", "reward"),
    [
        ("<think>two red, one blue</think> <answer>3</answer>", 1.0),
        ("<think>\nthinking\n</think> 3", 0.25),
        ("so <answer>\n3\n</answer>", 0.75),
        ("<think>unclosed <answer>3", 0.0),
        ("</think> backwards <think>", 0.0),
    ],
)
def test_format_gives_a_quarter_for_think_tags_and_three_quarters_for_answer_tags(response, reward):
    assert format_reward("3", response) == reward


def test_format_reads_the_tags_it_is_given():
    assert format_reward("3", "<reason>x</reason><final>3</final>", think_tag="reason", answer_tag="final") == 1.0
    assert format_reward("3", "<think>x</think><answer>3</answer>", think_tag="reason", answer_tag="final") == 0.0


@pytest.mark.parametrize(
    ("truth", "response", "reward"),
    [
        ("yes", "<answer> Yes. </answer>", 1.0),  # only letters and digits count, lowercased
        ("3", "<answer>three</answer>", 0.0),
        ("3", "the answer is 3", 0.0),  # no tags: no answer
        ("Blue cube", "<answer>blue-CUBE!</answer>", 1.0),
        # from the first <answer> to the last </answer>: '1</answer> or <answer>1' is not '1'
        ("1", "<answer>1</answer> or <answer>1</answer>", 0.0),
    ],
)
def test_exact_alnum_compares_the_answers_letters_and_digits(truth, response, reward):
    assert exact_alnum_reward(truth, response) == reward


@pytest.mark.parametrize(
    ("truth", "response", "reward"),
    [
        ("0.5", "<answer>\\frac{1}{2}</answer>", 1.0),
        ("2\\sqrt{3}", "<answer>2\\sqrt{3}</answer>", 1.0),
        ("2", "<answer>\\frac{1}{2}</answer>", 0.0),
        ("0.5", "\\boxed{0.5}", 0.0),  # the answer is what the tags hold, and there are none
    ],
)
def test_math_expr_grades_the_tagged_answer_as_math(truth, response, reward):
    assert math_expr_reward(truth, response) == reward


def test_bbox_giou_is_the_iou_above_the_threshold_and_the_generalized_iou_below():
    # truth [0,0,10,10], answer [1,1,11,11]: intersection 81, union 119, enclosing box 121
    iou, giou = 81 / 119, 81 / 119 - (121 - 119) / 121
    answer = "<answer>[1, 1, 11, 11]</answer>"
    assert bbox_giou_reward("[0, 0, 10, 10]", answer, giou_penalty_thres=0.5) == pytest.approx(iou)
    assert bbox_giou_reward("[0, 0, 10, 10]", answer) == pytest.approx(giou)  # default threshold 10: always GIoU
    # disjoint: intersection 0, union 200, enclosing [0,0,20,20] = 400 -> 0 - 200/400
    assert bbox_giou_reward("[0,0,10,10]", "<answer>[10,10,20,20]</answer>", 0.5) == pytest.approx(-0.5)
    assert bbox_giou_reward("[0,0,10,10]", "<answer>[1, 2, 3]</answer>") == 0.0  # not four numbers
    assert bbox_giou_reward("[0,0,10,10]", "[0,0,10,10]") == 0.0  # no tags


def test_geo3k_weighs_the_last_boxed_answer_and_the_format():
    assert geo3k_reward("3", "<think>x</think> so \\boxed{3}") == pytest.approx(1.0)
    assert geo3k_reward("3", "\\boxed{3}") == pytest.approx(0.9)  # no </think> before the box
    assert geo3k_reward("3", "</think> \\boxed{3} then \\boxed{4}") == pytest.approx(0.1)  # the last box counts
    assert geo3k_reward("\\frac{1}{2}", "</think> \\boxed{{1}/{2}}", format_score=0.5) == pytest.approx(1.0)


def test_the_reward_is_the_weighted_sum_with_weights_over_their_sum_and_each_part_a_component():
    clevr = env({"name": "format", "weight": 0.2}, {"name": "exact_alnum", "weight": 0.8})  # vlm_grpo_3B.yaml's
    result = clevr.step(
        [log("<think>count</think> <answer>3</answer>"), log("<answer>4</answer>"), log("3")],
        [{"ground_truth": "3"}] * 3,
    )
    assert result.rewards == pytest.approx([1.0, 0.2 * 0.75, 0.0])
    components = result.reward_components
    assert list(components) == ["exact_alnum", "format"]
    assert components["exact_alnum"] == pytest.approx([0.8, 0.0, 0.0])
    assert components["format"] == pytest.approx([0.2, 0.15, 0.0])
    doubled = env({"name": "format", "weight": 2}, {"name": "exact_alnum", "weight": 8})
    assert doubled.step([log("<answer>4</answer>")], [{"ground_truth": "3"}]).rewards == pytest.approx([0.15])


def test_a_ground_truth_in_answer_tags_is_what_they_hold_as_clevrs_solution_column():
    clevr = env({"name": "exact_alnum", "weight": 1})
    result = clevr.step(
        [log("<answer>3</answer>")] * 2, [{"ground_truth": "<answer> 3 </answer>"}, {"ground_truth": 3}]
    )
    assert result.rewards == [1.0, 1.0]


def test_the_completion_is_every_assistant_message_joined():
    result = env({"name": "format", "weight": 1}).step(
        [log("<think>a</think>", "<answer>3</answer>")], [{"ground_truth": "3"}]
    )
    assert result.rewards == [1.0]


def test_a_sample_without_ground_truth_scores_zero_with_its_error():
    result = env({"name": "format", "weight": 1}).step(
        [log("<answer>3</answer>"), log("x")], [{}, {"ground_truth": "3"}]
    )
    assert result.rewards == [0.0, 0.0] and result.reward_components == {"format": [0.0, 0.0]}
    assert "no ground_truth" in result.errors[0] and result.errors[1] is None


@pytest.mark.parametrize(
    ("functions", "message"),
    [
        ([], "at least 1 item"),
        ([{"name": "format", "weight": 1}, {"name": "format", "weight": 2}], "list each function once"),
        ([{"name": "format", "weight": 0}], "the weights sum to 0"),
        ([{"name": "bbox_giou", "weight": 1, "kwargs": {"threshold": 0.5}}], "bbox_giou takes giou_penalty_thres"),
        ([{"name": "accuracy", "weight": 1}], "format"),
    ],
)
def test_a_config_nemo_rl_would_not_run_is_refused(functions, message):
    with pytest.raises(ValidationError, match=message):
        VlmRewardsConfig.model_validate({"reward_functions": functions})


def test_the_vlm_environment_is_installed_and_passes_the_kit():
    from rlcore.testing.environment_kit import check_environment

    settings = {"reward_functions": [{"name": "format", "weight": 0.1}, {"name": "math_expr", "weight": 0.9}]}
    cases = [
        ("<think>x</think><answer>1/2</answer>", {"ground_truth": "0.5"}),
        ("<answer>2</answer>", {"ground_truth": "3"}),
    ]
    assert check_environment("vlm", settings, cases) == []
