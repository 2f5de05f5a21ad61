"""rlcore.preflight: a broken model or tokenizer is one line naming the config path, found before Ray starts."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlcore.config import load_config
from rlcore.preflight import check_model_sources, check_policy_sources

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "grpo_tiny.yaml"
DOES_NOT_EXIST = (
    "does not exist (set policy.model_name to a local Hugging Face model directory, "
    "or a hub name downloaded into the local cache)"
)


@pytest.fixture(scope="module")
def tiny() -> Path:
    from rlcore.testing.models import tiny_model_path

    return Path(tiny_model_path())


@pytest.fixture
def model(tiny: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny model, to break."""
    return Path(shutil.copytree(tiny, tmp_path / "model"))


def problems(*overrides: str) -> list[str]:
    return check_model_sources(load_config(EXAMPLE, list(overrides)))


def only_line(lines: list[str]) -> str:
    assert len(lines) == 1, lines
    return lines[0]


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]], sparse: bool = False) -> None:
    """A safetensors file of zeros with the given ``{name: (dtype, shape)}``, written byte by byte."""
    bits = {"F32": 32, "BF16": 16}
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        nbytes = bits[dtype] // 8
        for dim in shape:
            nbytes *= dim
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header).encode()
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        if sparse:
            f.truncate(8 + len(raw) + offset)  # a hole: the size is right, no data is written
        else:
            f.write(bytes(offset))


def write_index(directory: Path, weight_map: dict[str, str]) -> None:
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


# --------------------------------------------------------------------------- models that load


def test_healthy_tiny_model_has_no_problems(model: Path) -> None:
    assert problems(f"policy.model_name={model}") == []


def test_sharded_model_has_no_problems(model: Path) -> None:
    (model / "model.safetensors").unlink()
    write_safetensors(model / "model-00001-of-00002.safetensors", {"a": ("F32", [4, 4])})
    write_safetensors(model / "model-00002-of-00002.safetensors", {"b": ("BF16", [3])})
    write_index(model, {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"})
    assert problems(f"policy.model_name={model}") == []


def test_a_16gb_sharded_model_is_checked_in_well_under_a_second(model: Path) -> None:
    """Only headers are read: four sparse 4 GiB shards cost no more than a tiny model."""
    (model / "model.safetensors").unlink()
    weight_map = {}
    for i in range(1, 5):
        shard = f"model-{i:05d}-of-00004.safetensors"
        write_safetensors(model / shard, {f"layer{i}.weight": ("BF16", [32768, 65536])}, sparse=True)
        weight_map[f"layer{i}.weight"] = shard
    write_index(model, weight_map)
    assert sum((model / s).stat().st_size for s in set(weight_map.values())) > 16 * 1024**3
    try:
        start = time.perf_counter()
        assert problems(f"policy.model_name={model}") == []
        assert time.perf_counter() - start < 0.5
    finally:
        shutil.rmtree(model)  # sparse, but a 16 GB file left in /tmp would alarm whoever copies it


def test_separate_tokenizer_directory(model: Path, tiny: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).unlink()
    assert problems(f"policy.model_name={model}", f"policy.tokenizer.name={tiny}") == []


# --------------------------------------------------------------------------- broken models: one line each


def test_missing_directory(tmp_path: Path) -> None:
    missing = tmp_path / "gone"
    assert problems(f"policy.model_name={missing}") == [f"policy.model_name: {missing} {DOES_NOT_EXIST}"]


@pytest.mark.parametrize(("typed", "meant"), [("tiny-lama", "tiny-llama"), ("Qwen3-0.6B", "qwen3-0.6b")])
def test_a_near_miss_of_a_built_in_model_asks_did_you_mean_not_hf_download(typed: str, meant: str) -> None:
    """``tiny-lama`` was asked of the hub and answered with ``hf download tiny-lama``."""
    from rlcore.preflight.hub import hub_problems

    assert problems(f"policy.model_name={typed}") == [
        f"policy.model_name: {typed} is neither a local directory nor a model rlcore builds; did you mean "
        f"'{meant}'? (the models rlcore builds locally are in docs/models.md; a hub model is named org/name)"
    ]
    assert hub_problems([("policy.model_name", typed)]) == []  # not asked of the hub as well
    assert problems("policy.model_name=tiny-llama") == []


def test_a_file_instead_of_the_directory(model: Path) -> None:
    line = only_line(problems(f"policy.model_name={model / 'model.safetensors'}"))
    assert line.startswith(f"policy.model_name: {model / 'model.safetensors'} is a file; ")
    assert f"({model})" in line


def test_no_config_json(model: Path) -> None:
    (model / "config.json").unlink()
    assert only_line(problems(f"policy.model_name={model}")) == (
        f"policy.model_name: {model} has no config.json, so it is not a Hugging Face model directory "
        "(set policy.model_name to the directory save_pretrained wrote)"
    )


def test_config_json_invalid(model: Path) -> None:
    (model / "config.json").write_text('{"model_type": "llama",')
    line = only_line(problems(f"policy.model_name={model}"))
    assert line.startswith(f"policy.model_name: {model / 'config.json'} is not valid JSON (")
    assert line.endswith("); re-download or re-save the model")


def test_config_json_without_model_type(model: Path) -> None:
    (model / "config.json").write_text('{"hidden_size": 8}')
    assert only_line(problems(f"policy.model_name={model}")) == (
        f'policy.model_name: {model / "config.json"} has neither "model_type" nor "architectures", '
        "so no model class fits it; re-download or re-save the model"
    )


def test_no_weights(model: Path) -> None:
    (model / "model.safetensors").unlink()
    assert only_line(problems(f"policy.model_name={model}")) == (
        f"policy.model_name: {model} has no weights (expected model.safetensors, "
        "or model.safetensors.index.json with its shards); re-download or re-save the model"
    )


def test_safetensors_truncated_by_100_bytes(model: Path) -> None:
    weights = model / "model.safetensors"
    size = weights.stat().st_size
    os.truncate(weights, size - 100)
    assert only_line(problems(f"policy.model_name={model}")) == (
        f"policy.model_name: {weights} is truncated ({size - 100:,} bytes; its header describes {size:,}); "
        "re-download or re-save the model"
    )


def test_safetensors_with_trailing_bytes(model: Path) -> None:
    with (model / "model.safetensors").open("ab") as f:
        f.write(b"junk")
    assert "4 unexpected bytes after the last tensor" in only_line(problems(f"policy.model_name={model}"))


def test_safetensors_header_corrupted(model: Path) -> None:
    weights = model / "model.safetensors"
    with weights.open("r+b") as f:
        f.seek(8)
        f.write(b"\x00garbage\xff")
    line = only_line(problems(f"policy.model_name={model}"))
    assert line.startswith(f"policy.model_name: {weights} has a corrupted safetensors header (not valid JSON: ")


def test_safetensors_header_length_corrupted(model: Path) -> None:
    weights = model / "model.safetensors"
    with weights.open("r+b") as f:
        f.write(struct.pack("<Q", 2**40))
    line = only_line(problems(f"policy.model_name={model}"))
    assert line.startswith(
        f"policy.model_name: {weights} has a corrupted safetensors header (it claims {2**40:,} header bytes in a "
    )


def test_safetensors_unknown_dtype(model: Path) -> None:
    weights = model / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data.replace(b'"F32"', b'"Q32"', 1))  # same length: the layout is unchanged
    line = only_line(problems(f"policy.model_name={model}"))
    assert line.startswith(f"policy.model_name: {weights} has a corrupted safetensors header (tensor ")
    assert "has unknown dtype 'Q32'" in line


def test_index_lists_a_missing_shard(model: Path) -> None:
    (model / "model.safetensors").unlink()
    write_safetensors(model / "model-00001-of-00002.safetensors", {"a": ("F32", [2])})
    write_index(model, {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"})
    assert only_line(problems(f"policy.model_name={model}")) == (
        f"policy.model_name: {model / 'model.safetensors.index.json'} lists 1 shard file(s) that are missing: "
        "model-00002-of-00002.safetensors; re-download or re-save the model"
    )


def test_tokenizer_files_removed(model: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (model / name).unlink()
    assert only_line(problems(f"policy.model_name={model}")) == (
        f"policy.tokenizer.name: {model} (the directory of policy.model_name) has no tokenizer files "
        "(tokenizer.json, or tokenizer_config.json with a vocabulary file such as tokenizer.model or vocab.json); "
        "save the tokenizer there (tokenizer.save_pretrained) or set policy.tokenizer.name to a directory that has one"
    )


def test_tokenizer_config_without_vocabulary(model: Path, tmp_path: Path) -> None:
    tok = tmp_path / "tok"
    tok.mkdir()
    shutil.copy(model / "tokenizer_config.json", tok)
    line = only_line(problems(f"policy.model_name={model}", f"policy.tokenizer.name={tok}"))
    assert line.startswith(f"policy.tokenizer.name: {tok} has tokenizer_config.json but no vocabulary file")


def test_tokenizer_directory_missing(model: Path, tmp_path: Path) -> None:
    line = only_line(problems(f"policy.model_name={model}", f"policy.tokenizer.name={tmp_path / 'tok'}"))
    assert line.startswith(f"policy.tokenizer.name: {tmp_path / 'tok'} does not exist (set policy.tokenizer.name ")


# --------------------------------------------------------------------------- pytorch_model.bin


def bin_only(model: Path) -> Path:
    """The model with its weights as a torch zip archive (``torch.save``) instead of safetensors."""
    import torch

    (model / "model.safetensors").unlink()
    torch.save({"lm_head.weight": torch.zeros(2, 2)}, model / "pytorch_model.bin")
    return model


def test_pytorch_bin_is_fine_for_transformers_backends(model: Path) -> None:
    assert problems(f"policy.model_name={bin_only(model)}") == []


def test_pytorch_bin_truncated(model: Path) -> None:
    weights = bin_only(model) / "pytorch_model.bin"
    os.truncate(weights, weights.stat().st_size - 10)
    line = only_line(problems(f"policy.model_name={model}"))
    assert line.startswith(f"policy.model_name: {weights} is truncated or corrupted (")


def test_pytorch_bin_that_names_code_is_refused_in_rlcore_s_words(model: Path, tmp_path: Path) -> None:
    """The driver reads the pickle with the workers' weights-only reader (nothing runs) and says so in one line,
    not with transformers' error repeating torch's advice to turn weights_only off."""
    from rlcore.testing.payloads import torch_save_payload

    marker = tmp_path / "payload-ran"
    weights = bin_only(model) / "pytorch_model.bin"
    weights.write_bytes(torch_save_payload(marker, lambda evil: {"lm_head.weight": evil}))
    assert only_line(problems(f"policy.model_name={model}")) == (
        f"policy.model_name: {weights}: refusing to load posix.system (not an allowed checkpoint type): pickled "
        "weights that name code are never loaded; use safetensors weights"
    )
    assert not marker.exists()


def test_pytorch_bin_rejected_for_megatron(model: Path) -> None:
    """Megatron's own config check (rl_megatron.config), when the config is resolved, before anything starts."""
    from rlcore.config import ConfigError, resolve

    with pytest.raises(ConfigError) as caught:
        resolve(load_config(EXAMPLE, [f"policy.model_name={bin_only(model)}", "policy.backend=megatron"]))
    assert only_line(caught.value.problems) == (
        f"policy.model_name: {model} has only pytorch_model.bin weights, but the megatron backend reads "
        "safetensors only; convert once with AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir) "
        "(writes model.safetensors)"
    )


# --------------------------------------------------------------------------- hub names


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Hugging Face cache, offline."""
    from huggingface_hub import constants

    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_hub_name_not_in_cache_offline(hub_cache: Path) -> None:
    assert problems("policy.model_name=rlcore-test/absent-model") == [
        f"policy.model_name: rlcore-test/absent-model is not a local directory and not in the Hugging Face cache "
        f"({hub_cache}), and HF_HUB_OFFLINE is set: download it first (hf download rlcore-test/absent-model) "
        "or set policy.model_name to a local model directory"
    ]


def test_hub_name_in_cache_offline_is_checked_like_a_directory(hub_cache: Path, tiny: Path) -> None:
    repo = hub_cache / "models--rlcore-test--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    snapshot = Path(shutil.copytree(tiny, repo / "snapshots" / "abc123"))
    assert problems("policy.model_name=rlcore-test/tiny") == []
    (snapshot / "model.safetensors").unlink()
    assert only_line(problems("policy.model_name=rlcore-test/tiny")).startswith(
        f"policy.model_name: {snapshot} has no weights"
    )


def test_hub_name_online_is_left_to_the_download(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    assert problems("policy.model_name=rlcore-test/absent-model") == []


# --------------------------------------------------------------------------- generation model, Policy API


def test_generation_model_checked_when_the_engine_is_separate(model: Path, tmp_path: Path) -> None:
    missing = tmp_path / "gen"
    lines = problems(f"policy.model_name={model}", f"policy.generation.model_name={missing}")
    assert only_line(lines).startswith(f"policy.generation.model_name: {missing} does not exist (")


def test_generation_model_with_dummy_weights_needs_only_its_config(model: Path, tmp_path: Path) -> None:
    gen = tmp_path / "gen"
    gen.mkdir()
    shutil.copy(model / "config.json", gen)
    assert (
        problems(
            f"policy.model_name={model}",
            f"policy.generation.model_name={gen}",
            "policy.generation.vllm_cfg.load_format=dummy",
        )
        == []
    )


def test_policy_sources_use_weights_path_when_given(model: Path, tmp_path: Path) -> None:
    policy = load_config(EXAMPLE, [f"policy.model_name={tmp_path / 'gone'}"]).policy
    assert only_line(check_policy_sources(policy)).startswith("policy.model_name: ")
    assert check_policy_sources(policy, weights_path=model) == []
    (model / "config.json").unlink()
    assert only_line(check_policy_sources(policy, weights_path=model)).startswith(
        f"weights_path: {model} has no config.json"
    )


# --------------------------------------------------------------------------- the CLI


def test_cli_run_fails_in_one_line_before_ray(tmp_path: Path) -> None:
    """``rlcore run`` with a missing model exits non-zero within seconds, and never even imports ray.

    A stand-in ``ray`` package first on PYTHONPATH records any import of ray
    (and then fails it), so a run that got as far as starting Ray is caught
    even though other Ray instances may be running on this machine.
    """
    stub = tmp_path / "stub" / "ray"
    stub.mkdir(parents=True)
    marker = tmp_path / "ray-was-imported"
    (stub / "__init__.py").write_text(
        f"open({str(marker)!r}, 'w').close()\nraise ImportError('ray must not be imported before preflight')\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(stub.parent), os.environ.get("PYTHONPATH")]))}
    start = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlcore",
            "run",
            str(EXAMPLE),
            "-o",
            "policy.model_name=/nonexistent",
            "-o",
            f"logger.output_dir={tmp_path / 'run'}",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    elapsed = time.monotonic() - start
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("notice:")]
    assert proc.returncode != 0
    assert lines == [f"policy.model_name: /nonexistent {DOES_NOT_EXIST}"], proc.stderr
    assert not marker.exists(), "rlcore run imported ray before failing"
    assert not (tmp_path / "run").exists()
    assert elapsed < 10, f"took {elapsed:.1f} s"
