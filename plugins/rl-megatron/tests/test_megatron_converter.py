"""The HF ↔ Megatron weight mapping, in-process (no distributed run needed).

Round trips are bit-exact for Llama, Qwen2 (QKV bias) and Qwen3 (q/k norm),
tied and untied, at TP 1 and 2; the two layout traps (fused QKV grouped per
KV head, SwiGLU fc1 as [gate shard; up shard] per TP rank) are checked on
tensors whose rows name their origin. That the mapping computes the same
function as HF is checked by the logprob parity tests (test_megatron_parallel).
"""

from __future__ import annotations

import pytest
import torch
from megatron_helpers import model_dir

from rl_megatron.converter import (
    ModelShape,
    all_mappings,
    hf_shape,
    hf_to_megatron_state,
    megatron_to_hf_state,
    to_hf,
    to_megatron,
)

ARCH_CASES = [(arch, tied) for arch in ("llama", "qwen2", "qwen3") for tied in (False, True)]


def _load(arch: str, tied: bool) -> tuple[ModelShape, dict[str, torch.Tensor]]:
    from transformers import AutoConfig

    from rlcore.training.checkpoint import load_hf_state_dict

    path = model_dir(arch, tied)
    return ModelShape.from_hf_config(AutoConfig.from_pretrained(path)), load_hf_state_dict(path)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("arch, tied", ARCH_CASES)
def test_hf_megatron_hf_round_trip_is_bit_exact(arch: str, tied: bool, tp: int) -> None:
    shape, hf = _load(arch, tied)
    assert shape.qkv_bias == (arch == "qwen2") and shape.qk_norm == (arch == "qwen3")
    assert shape.tie_word_embeddings == tied
    shards = [hf_to_megatron_state(shape, hf, rank, tp) for rank in range(tp)]
    back = megatron_to_hf_state(shape, shards)
    expected = {k: v for k, v in hf.items() if not (tied and k == "lm_head.weight")}
    assert sorted(back) == sorted(expected)
    for name, tensor in expected.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
        assert tuple(tensor.shape) == hf_shape(shape, name), name
    # Every TP rank holds an equal share of every split parameter.
    for name in shards[0]:
        assert len({tuple(s[name].shape) for s in shards}) == 1, name
    assert ("output_layer.weight" in shards[0]) == (not tied)


def _shape(**kw) -> ModelShape:
    base = dict(
        architecture="Qwen2ForCausalLM",
        num_layers=1,
        hidden_size=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=1,
        intermediate_size=4,
        vocab_size=5,
        tie_word_embeddings=False,
        qkv_bias=True,
        qk_norm=False,
    )
    return ModelShape(**{**base, **kw})


def test_fused_qkv_is_grouped_per_kv_head_and_split_by_group() -> None:
    """[q0 q1 k0 v0 | q2 q3 k1 v1]: each KV group's query heads, then its key, then its value."""
    shape = _shape()
    mapping = next(m for m in all_mappings(shape) if m.megatron.endswith("linear_qkv.bias"))
    q, k, v = torch.tensor([0.0, 1, 2, 3]), torch.tensor([10.0, 11]), torch.tensor([20.0, 21])
    full = to_megatron(shape, mapping, [q, k, v], 0, 1)
    assert full.tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    shards = [to_megatron(shape, mapping, [q, k, v], r, 2) for r in range(2)]
    assert [s.tolist() for s in shards] == [[0, 1, 10, 20], [2, 3, 11, 21]]
    assert [t.tolist() for t in to_hf(shape, mapping, shards)] == [q.tolist(), k.tolist(), v.tolist()]


def test_swiglu_fc1_shard_is_gate_shard_then_up_shard() -> None:
    shape = _shape()
    mapping = next(m for m in all_mappings(shape) if m.megatron.endswith("linear_fc1.weight"))
    gate = torch.arange(4.0)[:, None].expand(4, 2)
    up = 10 + torch.arange(4.0)[:, None].expand(4, 2)
    shards = [to_megatron(shape, mapping, [gate, up], r, 2) for r in range(2)]
    assert [s[:, 0].tolist() for s in shards] == [[0, 1, 10, 11], [2, 3, 12, 13]]
    gate_back, up_back = to_hf(shape, mapping, shards)
    assert torch.equal(gate_back, gate) and torch.equal(up_back, up)


def test_vocab_is_padded_to_a_multiple_of_tp_and_unpadded_on_export() -> None:
    shape = _shape(vocab_size=5)
    mapping = all_mappings(shape)[0]
    embed = torch.arange(10.0).reshape(5, 2)
    shards = [to_megatron(shape, mapping, [embed], r, 2) for r in range(2)]
    assert [tuple(s.shape) for s in shards] == [(3, 2), (3, 2)] and shards[1][-1].abs().sum() == 0
    assert torch.equal(to_hf(shape, mapping, shards)[0], embed)


def test_tensor_parallel_size_must_divide_the_kv_heads() -> None:
    with pytest.raises(ValueError, match=r"tensor_model_parallel_size: 4 does not divide .*num_key_value_heads \(2\)"):
        _shape().check_tp(4)


def test_converter_type_selects_the_mapping() -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir("qwen3"))
    assert ModelShape.from_hf_config(config).qk_norm
    assert not ModelShape.from_hf_config(config, "LlamaForCausalLM").qk_norm
    with pytest.raises(ValueError, match="converter_type: no weight mapping for 'GPT2LMHeadModel'"):
        ModelShape.from_hf_config(config, "GPT2LMHeadModel")


@pytest.mark.parametrize("tp", [1, 2])
def test_value_model_maps_the_trunk_and_the_score_head(tp: int) -> None:
    """A value model (model_head='value') read from a tied causal LM's config: untied, no vocabulary output layer,
    HF's ``score`` in the output layer's place (replicated over TP); HF → Megatron → HF is bit-exact, lm_head
    is never read."""
    from transformers import AutoConfig

    from rlcore.training.checkpoint import load_hf_state_dict

    path = model_dir("qwen2", tied=True)
    shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(path), value_head=True)
    assert shape.value_head and not shape.tie_word_embeddings
    hf = {k: v for k, v in load_hf_state_dict(path).items() if k != "lm_head.weight"}
    hf["score.weight"], hf["score.bias"] = torch.randn(1, shape.hidden_size), torch.randn(1)
    shards = [hf_to_megatron_state(shape, hf, rank, tp) for rank in range(tp)]
    assert all(torch.equal(s["output_layer.weight"], hf["score.weight"]) for s in shards)
    back = megatron_to_hf_state(shape, shards)
    assert sorted(back) == sorted(hf)
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor) and tuple(tensor.shape) == hf_shape(shape, name), name


def test_value_model_reads_a_token_classification_config() -> None:
    """A saved value model's config names the token-classification class: its trunk maps as the causal LM's; a
    language model refuses it (it has no lm_head)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir("qwen3"))
    config.architectures = ["Qwen3ForTokenClassification"]
    shape = ModelShape.from_hf_config(config, value_head=True)
    assert shape.architecture == "Qwen3ForCausalLM" and shape.qk_norm and shape.value_head
    with pytest.raises(ValueError, match="no weight mapping for 'Qwen3ForTokenClassification'"):
        ModelShape.from_hf_config(config)
