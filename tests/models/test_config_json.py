"""``rlcore.models.config_json``: a model's ``config.json`` from a directory or the hub cache, without network.

The configs are the ones transformers writes (``save_pretrained`` of the built-in models' configs); the
reference is transformers' own loading of the same files (``AutoConfig``, offline).
"""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from rlcore.models import has_vision_config, model_config, read_config_json, vlm_config
from rlcore.training.vision import is_vision_language

SHA = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``{kind: directory}``: a vision-language and a text model's saved configs."""
    root = tmp_path_factory.mktemp("configs")
    dirs = {"vlm": root / "vlm", "text": root / "text"}
    vlm_config().save_pretrained(dirs["vlm"])
    model_config("qwen2").save_pretrained(dirs["text"])
    return {kind: str(path) for kind, path in dirs.items()}


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty hub cache that huggingface_hub uses (it reads ``HF_HUB_CACHE`` once, at import)."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def cache_repo(cache, repo_id: str, config_dir: str) -> None:
    """Lay ``config_dir``'s ``config.json`` out as huggingface_hub caches ``repo_id`` at ``main``."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(SHA)
    (repo / "snapshots" / SHA).mkdir(parents=True)
    (repo / "snapshots" / SHA / "config.json").write_text(open(f"{config_dir}/config.json").read())


@pytest.mark.parametrize("kind", ["vlm", "text"])
def test_a_directorys_config_is_what_transformers_loads(saved, kind):
    config = read_config_json(saved[kind])
    loaded = AutoConfig.from_pretrained(saved[kind])
    assert config is not None and config["model_type"] == loaded.model_type
    assert has_vision_config(saved[kind]) is is_vision_language(loaded) is (kind == "vlm")
    if kind == "vlm":
        assert config["image_token_id"] == loaded.image_token_id


def test_a_hub_id_is_read_from_the_hub_cache(saved, hub_cache):
    cache_repo(hub_cache, "org/seeing", saved["vlm"])
    cache_repo(hub_cache, "org/reading", saved["text"])
    for repo_id, kind in (("org/seeing", "vlm"), ("org/reading", "text")):
        loaded = AutoConfig.from_pretrained(repo_id, cache_dir=str(hub_cache), local_files_only=True)
        assert read_config_json(repo_id) is not None and read_config_json(repo_id) == read_config_json(saved[kind])
        assert has_vision_config(repo_id) is is_vision_language(loaded) is (kind == "vlm")


def test_no_config_to_read_is_none_and_no_vision(saved, hub_cache, tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "listed").mkdir()
    (tmp_path / "listed" / "config.json").write_text("[1, 2]")
    cache_repo(hub_cache, "org/other", saved["vlm"])
    missing = [
        str(tmp_path / "empty"),  # a directory without config.json
        str(tmp_path / "listed"),  # a config.json that is not a JSON object
        str(tmp_path / "nowhere"),  # a path that is not there (nor a hub id)
        "org/not-cached",  # a hub id not in the cache: not downloaded
    ]
    for model in missing:
        assert read_config_json(model) is None, model
        assert not has_vision_config(model), model
