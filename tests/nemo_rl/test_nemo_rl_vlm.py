"""Issue 57: NeMo-RL's vision-language recipes convert as written.

The references are NeMo-RL's own loaders at the fixtures' commit (main 7ea279a): ``response_datasets/clevr.py``
(three hub repositories, one per split, each read as its 'train' split; the image in ``image``, the question in
``problem``, the answer in ``solution``'s ``<answer>`` tags), ``geometry3k.py`` (``hiyouga/geometry3k``), the VLM
script's environments (``nemo_rl/data/utils.py``: every env the data names is the VLM environment) and
``vlm_hf_data_processor`` (the image before the prompt file's text, formatted with the question).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rlcore.nemo_rl import convert, convert_file, load_nemo_rl_config, load_nemo_rl_dict

MAIN = Path(__file__).parents[1] / "fixtures" / "nemo_rl" / "main"
GRPO = MAIN / "vlm_grpo_3B.yaml"
SFT = MAIN / "sft_vlm_3B.yaml"
CLEVR = "MMInstruction/Clevr_CoGenT_"


def test_vlm_grpo_3b_reads_clevr_from_the_hub_and_scores_with_the_vlm_environment():
    out = convert_file(GRPO)
    data, env = out.config["data"], out.config["env"]
    assert data["train"] == {"hub_id": f"{CLEVR}TrainA_70K_Complex", "split": "train", "format": "clevr_cogent"}
    assert data["validation"] == {"hub_id": f"{CLEVR}ValA", "split": "train", "format": "clevr_cogent"}  # 'valA'
    assert (data["input_key"], data["output_key"], data["image_key"]) == ("problem", "solution", "image")
    assert data["prompt_file"] == str(Path("examples/prompts/clevr_cogent_cot.txt").absolute())
    assert env == {
        "name": "vlm",
        "num_workers": 8,
        "vlm_cfg": {"reward_functions": [{"name": "format", "weight": 0.2}, {"name": "exact_alnum", "weight": 0.8}]},
    }
    assert out.sources["env.name"] == "data.default.env_name"
    assert out.config["policy"]["generation"]["vllm_cfg"]["engine_kwargs"] == {"mm_processor_cache_gb": 0}
    ignored = dict(out.ignored)
    assert "vlm_hf_data_processor" in ignored["data.default.processor"]
    assert "transport and memory only" in ignored["grpo.deduplicate_multimodal_data"]
    assert "no data entry's env_name names it" in ignored["env.geometry3k"]  # the sections the data does not name


def test_sft_vlm_3b_reads_clevr_with_its_image_column():
    out = convert_file(SFT)
    data = out.config["data"]
    assert data["train"] == {"hub_id": f"{CLEVR}TrainA_70K_Complex", "split": "train", "format": "clevr_cogent"}
    assert data["validation"] == {"hub_id": f"{CLEVR}ValA", "split": "train", "format": "clevr_cogent"}
    assert (data["input_key"], data["output_key"], data["image_key"]) == ("problem", "solution", "image")
    assert "prompt_file" not in data and "env" not in out.config
    assert out.notes == []  # the rows are NeMo-RL's: the clevr_cogent format cuts the answer out of its tags


def test_geometry3k_reads_its_images_column_and_the_math_expr_reward():
    out = convert_file(
        GRPO,
        [
            "data.train.dataset_name=geometry3k",
            "data.validation.dataset_name=geometry3k",
            "data.validation.split=validation",
            "data.default.env_name=geometry3k",
        ],
    )
    data, env = out.config["data"], out.config["env"]
    assert data["train"] == {"hub_id": "hiyouga/geometry3k", "split": "train", "format": "geometry3k"}
    assert data["validation"] == {"hub_id": "hiyouga/geometry3k", "split": "validation", "format": "geometry3k"}
    assert (data["input_key"], data["output_key"], data["image_key"]) == ("problem", "answer", "images")
    assert env["vlm_cfg"]["reward_functions"] == [
        {"name": "format", "weight": 0.1},
        {"name": "math_expr", "weight": 0.9},
    ]
    assert out.notes == []


def test_an_env_section_named_vlm_is_the_vlm_environment_too():
    out = convert_file(
        GRPO,
        [
            "data.default.env_name=vlm",
            "+env.vlm={num_workers: 2, stop_strings: null, reward_functions: [{name: bbox_giou, weight: 1, "
            "kwargs: {giou_penalty_thres: 0.5}}]}",
        ],
    )
    assert out.problems == []
    assert out.config["env"] == {
        "name": "vlm",
        "num_workers": 2,
        "vlm_cfg": {"reward_functions": [{"name": "bbox_giou", "weight": 1, "kwargs": {"giou_penalty_thres": 0.5}}]},
    }
    assert "read nowhere" in dict(out.ignored)["env.vlm.stop_strings"]


@pytest.mark.parametrize(
    ("overrides", "line"),
    [
        (["data.validation.split=test"], "data.validation.split: is 'test', a split NeMo-RL does not read for this"),
        (["~data.default.env_name"], "data.train.env_name: is missing, and NeMo-RL's VLM script scores with"),
        (["data.default.processor=math_hf_data_processor"], "data.default.processor: is 'math_hf_data_processor', a"),
        (["++env.clevr-cogent.verifier=strict"], "env.clevr-cogent.verifier: is 'strict', a key NeMo-RL's VLM env"),
        (
            ["++policy.dtensor_cfg.automodel_kwargs.freeze_config.freeze_language_model=true"],
            "policy.dtensor_cfg.automodel_kwargs.freeze_config.freeze_language_model: is true, but rlcore trains",
        ),
        (
            ["++policy.dtensor_cfg.automodel_kwargs.backend.attn=te"],
            'policy.dtensor_cfg.automodel_kwargs.backend: is {"attn": "te"}, a NeMo Automodel option',
        ),
    ],
)
def test_what_nemo_rl_would_not_run_or_rlcore_cannot_do_is_one_line_with_the_fix(overrides, line):
    problems = convert(load_nemo_rl_dict(GRPO, overrides)).problems
    assert len(problems) == 1 and problems[0].startswith(line), problems


def test_the_vision_keys_map_to_rlcores():
    out = convert_file(
        GRPO,
        [
            "++policy.generation.vllm_cfg.limit_mm_per_prompt={image: 1}",
            "++policy.dtensor_cfg.automodel_kwargs.freeze_config.freeze_vision_tower=true",
            "++policy.dtensor_cfg.automodel_kwargs.freeze_config.freeze_audio_tower=true",
            "grpo.deduplicate_multimodal_data=true",
        ],
    )
    assert out.problems == []
    assert out.config["policy"]["generation"]["vllm_cfg"]["limit_mm_per_prompt"] == {"image": 1}
    assert out.config["policy"]["freeze_vision_tower"] is True
    ignored = dict(out.ignored)
    assert "no audio" in ignored["policy.dtensor_cfg.automodel_kwargs.freeze_config.freeze_audio_tower"]
    assert "grpo.deduplicate_multimodal_data" in ignored


def test_rl_vllm_takes_the_converted_engine_settings():
    config = pytest.importorskip("rl_vllm.config")
    out = convert_file(GRPO, ["++policy.generation.vllm_cfg.limit_mm_per_prompt={image: 1}"])
    section = config.VllmConfig.model_validate(out.config["policy"]["generation"]["vllm_cfg"])
    assert section.limit_mm_per_prompt == {"image": 1} and section.engine_kwargs == {"mm_processor_cache_gb": 0}


def test_the_converted_config_resolves_on_backends_that_take_images():
    """With the built-in tiny Qwen2.5-VL: the only problems left, if any, are backends not declaring image_inputs
    (other issues give them the capability)."""
    from rlcore.config import ConfigError
    from rlcore.config.resolve import resolve

    loaded = load_nemo_rl_config(GRPO, [], ["policy.model_name=tiny-qwen2.5-vl", "cluster.use_gpu=false"])
    assert loaded.config.policy.generation.backend == "vllm"
    try:
        resolved = resolve(loaded.config, run=True)
    except ConfigError as exc:
        assert all("does not declare 'image_inputs'" in line for line in exc.problems), exc.problems
        return
    assert resolved.environment.spec.name == "vlm"
    assert [f.name for f in resolved.environment.section.reward_functions] == ["format", "exact_alnum"]


# -- the hub dataset, through rlcore's data path --------------------------------------------------------------


def _parquet(tmp_path: Path, rows: list[dict], name: str) -> bytes:
    """Rows written by ``datasets`` with the image column a ``datasets.Image`` feature, as the hub's files are."""
    import datasets

    features = datasets.Features(
        {"image": datasets.Image(), "problem": datasets.Value("string"), "solution": datasets.Value("string")}
    )
    path = tmp_path / f"{name}.parquet"
    datasets.Dataset.from_list(rows, features=features).to_parquet(str(path))
    return path.read_bytes()


def _png(size: tuple[int, int], color: str) -> dict:
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format="PNG")
    return {"bytes": buffer.getvalue(), "path": None}


def test_clevr_from_a_hub_cache_loads_into_samples_with_their_images(tmp_path, monkeypatch):
    from rlcore.datasets import load_sources
    from rlcore.environments.vlm_rewards import VlmRewardsConfig, VlmRewardsEnvironment
    from tests.support.hub_cache import hub_cache

    home = tmp_path / "hf"
    for name, value in (("HF_HOME", str(home)), ("HF_HUB_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1")):
        monkeypatch.setenv(name, value)
    for name in ("HF_HUB_CACHE", "HF_DATASETS_CACHE"):
        monkeypatch.delenv(name, raising=False)
    train = [
        {"image": _png((32, 24), "red"), "problem": "How many cubes?", "solution": "<answer> 3 </answer>"},
        {"image": _png((16, 16), "blue"), "problem": "Is there a sphere?", "solution": "<answer> yes </answer>"},
    ]
    val = [{"image": _png((20, 10), "green"), "problem": "How many spheres?", "solution": "<answer> 1 </answer>"}]
    hub_cache(home, f"{CLEVR}TrainA_70K_Complex", {"data/train-00000-of-00001.parquet": _parquet(tmp_path, train, "t")})
    hub_cache(home, f"{CLEVR}ValA", {"data/train-00000-of-00001.parquet": _parquet(tmp_path, val, "v")})
    prompt = tmp_path / "cot.txt"
    prompt.write_text("Answer in <answer></answer> tags.\n{}")

    nemo_overrides = [
        f"data.default.prompt_file={prompt}",
        "grpo.num_prompts_per_step=2",
        "policy.train_global_batch_size=32",
    ]
    loaded = load_nemo_rl_config(GRPO, nemo_overrides, ["policy.model_name=tiny-qwen2.5-vl"])
    run_data = load_sources(loaded.config, images=True)
    samples = sorted(run_data.train.samples[:2], key=lambda s: s.idx)
    first = samples[0]
    assert [image.size for image in first.images] == [(32, 24)]
    assert first.images[0].getpixel((0, 0)) == (255, 0, 0)
    assert first.messages == [
        {
            "role": "user",
            "content": [
                {"type": "image"},
                {"type": "text", "text": "Answer in <answer></answer> tags.\nHow many cubes?"},
            ],
        }
    ]
    assert first.metadata["ground_truth"] == "3" and "image" not in first.metadata  # the text of the tags
    [validation] = run_data.validation
    assert validation.images[0].size == (20, 10) and validation.metadata["ground_truth"] == "1"
    scores = VlmRewardsEnvironment(VlmRewardsConfig.model_validate(loaded.config.env.backend_sections["vlm_cfg"]))
    answers = ("<think>x</think><answer>3</answer>", "<think>x</think><answer>no</answer>")
    logs = [[*s.messages, {"role": "assistant", "content": a}] for s, a in zip(samples, answers)]
    assert scores.step(logs, [s.metadata for s in samples]).rewards == pytest.approx([1.0, 0.2])


@pytest.mark.parametrize("name", ["sft_avlm.yaml", "audio_grpo_3B_megatron.yaml"])
def test_the_audio_recipes_are_refused_naming_what_is_missing(name):
    from rlcore.config import ConfigError

    with pytest.raises(ConfigError) as refused:
        convert_file(MAIN / name)
    audio = [p for p in refused.value.problems if "one of NeMo-RL's audio datasets" in p]
    assert audio and all(p.startswith("data.") and "no audio or video inputs" in p for p in audio), audio
