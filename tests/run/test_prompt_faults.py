"""Prompt faults found before Ray starts, in one line (issue 44): a prompt file with a literal ``{}`` says to write
literal braces as ``{{}}`` (item 5; it said "names tuple index out of range, which the row does not have"), and a
multi-turn run whose prompt leaves no room in the context is refused as a single-turn run is (item 14; it was a
``ValueError`` after Ray started)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlcore.config import load_config
from rlcore.datasets import DataError, load_sources
from tests.run.test_output_dir_owner import BEFORE_RAY_S, rlcore_without_ray

REPO = Path(__file__).resolve().parents[2]
MULTI_TURN = REPO / "examples" / "grpo_multiturn_tiny.yaml"
ROWS = [{"problem": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(4)]


def math_config(tmp_path: Path, prompt: str) -> object:
    data, prompt_file = tmp_path / "math.jsonl", tmp_path / "prompt.txt"
    data.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    prompt_file.write_text(prompt)
    return load_config(
        None,
        [
            f"data.train.path={data}",
            "data.input_key=problem",
            "data.output_key=answer",
            f"data.prompt_file={prompt_file}",
            "grpo.num_prompts_per_step=2",
        ],
    )


def test_a_literal_pair_of_braces_in_a_prompt_file_says_to_double_them(tmp_path: Path) -> None:
    cfg = math_config(tmp_path, "Reply as JSON, e.g. {}.\n{}")
    with pytest.raises(DataError) as err:
        load_sources(cfg)
    assert str(err.value) == (
        f"data.prompt_file ({tmp_path / 'prompt.txt'}): has 2 '{{}}' fields, but a prompt "
        "fills only the first (with the row's 'problem'); write literal braces as '{{}}'"
    )


def test_doubled_braces_are_the_literal_ones_as_in_nemo_rl_s_prompt_files(tmp_path: Path) -> None:
    cfg = math_config(tmp_path, "Put the answer in \\boxed{{}}.\n{}\nAnswer:")
    data = load_sources(cfg)
    assert data.train.batch(0)[0].messages[-1]["content"] in {
        f"Put the answer in \\boxed{{}}.\n{row['problem']}\nAnswer:" for row in ROWS
    }


@pytest.mark.parametrize(
    "prompt, says",
    [
        (
            "{question}\n{}",
            r"names 'question', which the row does not have \(it has problem, answer\); write a literal "
            r"brace as '\{\{' or '\}\}'",
        ),
        ('{"a": 1} {}', r"""names '"a"', which the row does not have \(it has problem, answer\); write a literal"""),
        ("x { y {}", r"not a format string \(.*\); write literal braces as '\{\{' and '\}\}'"),
    ],
)
def test_other_brace_faults_name_the_fix_too(tmp_path: Path, prompt: str, says: str) -> None:
    with pytest.raises(DataError, match=says):
        load_sources(math_config(tmp_path, prompt))


def multi_turn_example() -> tuple[object, object, int]:
    """The multi-turn example as a run resolves it, its tokenizer, and its first prompt's length as the rollout
    encodes it (:func:`rlcore.run.step.encode_prompts`, the check that used to fire after Ray started)."""
    from rlcore.config import resolve
    from rlcore.run.prompts import load_tokenizer, render_prompts
    from rlcore.run.step import encode_prompts

    cfg = resolve(load_config(MULTI_TURN), run=True).config
    tokenizer = load_tokenizer(cfg)
    first = load_sources(cfg).train.batch(0)[0]
    rendered = render_prompts(tokenizer, [first.messages], cfg.policy.tokenizer.chat_template_kwargs)
    return cfg, tokenizer, int(encode_prompts(tokenizer, rendered, 1)["input_lengths"][0])


def with_limit(cfg: object, max_total: int) -> object:
    return cfg.model_copy(update={"policy": cfg.policy.model_copy(update={"max_total_sequence_length": max_total})})


def test_a_multi_turn_prompt_that_leaves_no_room_is_found_with_the_data() -> None:
    from rlcore.run.build import load_run_data

    cfg, tokenizer, length = multi_turn_example()
    assert cfg.grpo.max_rollout_turns > 1 and cfg.data.train.generator
    load_run_data(cfg, tokenizer)  # the example as shipped fits
    with pytest.raises(DataError) as err:
        load_run_data(with_limit(cfg, length), tokenizer)
    assert str(err.value) == (
        f"data.train.generator (rlcore.environments.guessing:guessing_games): step 0 item 1: the prompt is {length} "
        f"tokens, which leaves no room for a completion within policy.max_total_sequence_length={length}: shorten "
        "or drop the item, or raise the limit"
    )
    load_run_data(with_limit(cfg, length + 1), tokenizer)  # one token of room is enough


def test_rlcore_run_of_a_multi_turn_prompt_too_long_is_one_line_before_ray(tmp_path: Path) -> None:
    _, _, length = multi_turn_example()
    proc, took = rlcore_without_ray(
        tmp_path,
        str(MULTI_TURN),
        "-o",
        f"policy.max_total_sequence_length={length}",
        "-o",
        f"logger.output_dir={tmp_path / 'run'}",
    )
    lines = [ln for ln in proc.stderr.splitlines() if not ln.startswith("notice:")]
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(
        f"error: data.train.generator (rlcore.environments.guessing:guessing_games): step 0 "
        f"item 1: the prompt is {length} tokens, which leaves no room"
    ), lines
    assert took < BEFORE_RAY_S and not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "prompt",
    ["Solve {}. Put the final answer in \\boxed{}.", "Reply as JSON, e.g. {}.\n{}", "x { y {}"],
)
def test_config_validate_finds_the_brace_faults_a_run_finds_with_its_rows(tmp_path: Path, prompt: str) -> None:
    """A single-brace \\boxed{} was found only when the run read its rows (after the workers had started, under
    NeMo-RL's data path), though config validate said OK. The preflight's line is the one the run gives."""
    from rlcore.preflight.config import template_problems

    cfg = math_config(tmp_path, prompt)
    with pytest.raises(DataError) as err:
        load_sources(cfg)
    assert template_problems(cfg.data) == [str(err.value)]
    assert template_problems(math_config(tmp_path, "Put the answer in \\boxed{{}}.\n{}").data) == []


def test_prompts_are_measured_again_with_the_environments_tools_once_it_is_built(tmp_path: Path) -> None:
    """The tools the environment declares go into the first prompt's chat template (Qwen2.5's lists them in the
    system turn): a prompt that fits without them may not fit with them. build_run measures the checked prompts
    again, and installs the check for the rows drawn later."""
    from rlcore.run.build import check_prompts_with_tools
    from rlcore.run.step import prompt_length_of
    from tests.chat.tokenizers import qwen_style_tokenizer

    tokenizer = qwen_style_tokenizer()
    cfg = math_config(tmp_path, "{}")
    tool = {"type": "function", "function": {"name": "lookup", "description": "x" * 600, "parameters": {}}}
    longest = max(prompt_length_of(cfg, tokenizer, [tool])(s) for s in load_sources(cfg).train.samples)
    without = max(prompt_length_of(cfg, tokenizer)(s) for s in load_sources(cfg).train.samples)
    assert without < 400 < longest  # the reference: the template rendered with and without the tools
    cfg = cfg.model_copy(update={"policy": cfg.policy.model_copy(update={"max_total_sequence_length": 400})})
    data = load_sources(cfg, prompt_length_of(cfg, tokenizer))  # fits without the tools
    check_prompts_with_tools(cfg, tokenizer, data, None)  # no tools: nothing more to check
    with pytest.raises(DataError, match=r"math.jsonl: row 1: the prompt is \d+ tokens, which leaves no room"):
        check_prompts_with_tools(cfg, tokenizer, data, [tool])
    with pytest.raises(DataError, match=r"row 3: the prompt is \d+ tokens"):
        data.train.samples[2]  # a row drawn later is measured with the tools too
