"""The real-size presets (qwen2.5-0.5b, qwen3-0.6b, llama-3.2-1b, qwen3-30b-a3b): shapes, counts, cache keys, builds.

Nothing here allocates a preset's weights: counts come from the meta device,
and the end-to-end build uses a preset's settings at one small layer.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
import transformers

from rlcore.models import BUILTIN_MODELS, build, cache, resolve_model
from rlcore.models.presets import PARAMETER_COUNTS, PRESETS, preset

SMALL = dict(
    num_layers=1, hidden_size=64, num_heads=2, num_kv_heads=1, head_dim=32, intermediate_size=128, vocab_size=512
)


def meta_model(config):
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_parameter_count_is_the_real_one(name):
    model = meta_model(build.model_config(**PRESETS[name]))
    assert sum(p.numel() for p in model.parameters()) == PARAMETER_COUNTS[name]
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    assert tied == PRESETS[name]["tie_word_embeddings"]


def test_preset_configs():
    qwen2 = build.model_config(**PRESETS["qwen2.5-0.5b"])
    qwen3 = build.model_config(**PRESETS["qwen3-0.6b"])
    llama = build.model_config(**PRESETS["llama-3.2-1b"])
    for cfg in (qwen2, qwen3):
        assert cfg.vocab_size == 151936 and cfg.tie_word_embeddings
        assert cfg.rope_parameters == {"rope_type": "default", "rope_theta": 1e6}
        assert cfg.rms_norm_eps == 1e-6
    assert (qwen2.model_type, qwen2.max_position_embeddings, qwen2.num_key_value_heads) == ("qwen2", 32768, 2)
    assert (qwen3.model_type, qwen3.max_position_embeddings, qwen3.head_dim) == ("qwen3", 40960, 128)
    assert llama.model_type == "llama" and llama.vocab_size == 128256 and llama.tie_word_embeddings
    assert llama.rms_norm_eps == 1e-5 and llama.max_position_embeddings == 131072
    assert llama.rope_parameters == {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }


def test_presets_are_builtin_names(tmp_path, monkeypatch):
    monkeypatch.setenv("RLCORE_CACHE", str(tmp_path))
    built = []
    monkeypatch.setattr(
        cache, "build_tiny_model", lambda save_dir, **kw: built.append(kw) or (Path(save_dir) / "config.json").touch()
    )
    for name in PRESETS:
        assert name in BUILTIN_MODELS
        assert Path(resolve_model(name)).parent == tmp_path / "tiny-models"
    assert built == [PRESETS[name] for name in PRESETS]
    assert preset("qwen3-0.6b", num_layers=1)["num_layers"] == 1 and PRESETS["qwen3-0.6b"]["num_layers"] == 28
    with pytest.raises(KeyError, match="unknown preset"):
        preset("gpt2")


def first_release_key(**kwargs) -> str:
    """The cache directory name as the first release computed it (before rope/norm arguments existed)."""
    defaults = dict(
        arch="llama",
        hidden_size=64,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=32,
        intermediate_size=128,
        vocab_size=None,
        tie_word_embeddings=False,
        seed=0,
        dtype="float32",
        max_position_embeddings=512,
        initializer_range=0.02,
    )
    key = {name: str(value) for name, value in dict(defaults, **kwargs).items()}
    key["_transformers"] = transformers.__version__
    key["_build"] = "1"
    return f"{key['arch']}-{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]}"


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-qwen3", None])
def test_tiny_model_cache_keys_unchanged(tmp_path, monkeypatch, name):
    kwargs = BUILTIN_MODELS[name] if name else {}
    monkeypatch.setattr(cache, "build_tiny_model", lambda *a, **k: pytest.fail("rebuilt"))
    expected = tmp_path / first_release_key(**kwargs)
    expected.mkdir()
    (expected / "config.json").write_text("{}")
    assert build.BUILD_VERSION == 1
    assert cache.tiny_model_path(cache_root=tmp_path, **kwargs) == str(expected)
    # the later arguments given at their default (None) hash the same; a set one does not
    none = dict.fromkeys(build.LATER_ARGUMENTS)
    assert cache.tiny_model_path(cache_root=tmp_path, **kwargs, **none) == str(expected)
    assert first_release_key(**kwargs, rope_theta=1e6) != first_release_key(**kwargs)


def test_tiny_model_config_unchanged():
    """Arguments left at None are not passed: the config is transformers' default, as before."""
    cfg = build.model_config("qwen2")
    assert cfg.rope_parameters == transformers.Qwen2Config().rope_parameters
    assert cfg.rms_norm_eps == transformers.Qwen2Config().rms_norm_eps


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_small_preset_builds_loads_and_runs(tmp_path, name):
    args = preset(name, **SMALL)
    path = build.build_tiny_model(tmp_path / "m", **args)
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    cfg = model.config
    assert cfg.model_type == PRESETS[name]["arch"]
    assert cfg.rope_parameters == build.model_config(**PRESETS[name]).rope_parameters
    assert cfg.rms_norm_eps == PRESETS[name]["rms_norm_eps"]
    assert cfg.tie_word_embeddings == PRESETS[name]["tie_word_embeddings"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    assert len(tokenizer) <= cfg.vocab_size
    ids = torch.tensor([tokenizer.encode("hello world")])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], 512) and torch.isfinite(logits).all()


def test_large_vocab_rows_beyond_the_tokenizer(tmp_path):
    """A preset's vocabulary rows exceed the byte-level tokenizer: ids past it decode to nothing."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        build.build_tiny_model(tmp_path / "m", **preset("qwen2.5-0.5b", **dict(SMALL, vocab_size=151936)))
    )
    # 259 byte-level tokens (AutoTokenizer gives qwen2 models a Qwen2Tokenizer, which adds <|endoftext|>)
    assert len(tokenizer) <= 260
    assert tokenizer.decode([ord("a") + 3, 151935, 1000]) == "a"


def test_moe_preset_and_tiny_moe():
    """The Qwen3-MoE shapes: 128 experts top-8 at real size; the tiny one 8 experts top-2 with an aux loss."""
    real = build.model_config(**PRESETS["qwen3-30b-a3b"])
    assert (real.model_type, real.num_experts, real.num_experts_per_tok, real.moe_intermediate_size) == (
        "qwen3_moe",
        128,
        8,
        768,
    )
    assert real.norm_topk_prob and real.router_aux_loss_coef == 0.001 and not real.tie_word_embeddings
    tiny = build.model_config(**BUILTIN_MODELS["tiny-qwen3-moe"])
    assert (tiny.num_experts, tiny.num_experts_per_tok, tiny.moe_intermediate_size) == (8, 2, 64)
    model = transformers.AutoModelForCausalLM.from_config(tiny)
    ids = torch.tensor([[5, 6, 7, 8]])
    out = model(input_ids=ids, labels=ids, output_router_logits=True)
    # the loss includes the load-balancing term: the plain cross-entropy plus coef x aux
    assert out.aux_loss is not None and out.aux_loss > 0
    ce = torch.nn.functional.cross_entropy(out.logits[0, :-1], ids[0, 1:])
    torch.testing.assert_close(out.loss, ce + tiny.router_aux_loss_coef * out.aux_loss)


def test_moe_arguments_need_the_moe_arch():
    with pytest.raises(ValueError, match="need arch 'qwen3_moe'"):
        build.model_config("qwen3", num_experts=8)
    with pytest.raises(ValueError, match="exceeds num_experts"):
        build.model_config("qwen3_moe", num_experts=2, num_experts_per_tok=4)
