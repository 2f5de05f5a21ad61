"""In-process tests of the pieces around FSDP (no Ray, no process group): generation, layout, settings."""

from __future__ import annotations

import pytest
import torch

from rl_fsdp1 import generation as gen
from rl_fsdp1.sharding import ParamLayout, clean_name, decoder_layer_classes, fsdp_kwargs
from rlcore.config.generation import GenerationConfig
from rlcore.data import BatchedDataDict
from rlcore.testing.conformance import generation_output_problems, hf_token_logprobs, load_hf_model


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    return load_hf_model(tiny_model_dir).eval()


def prompts(tokenizer, texts: list[str]) -> BatchedDataDict:
    encoded = [tokenizer.encode(t) for t in texts]
    width = max(len(e) for e in encoded)
    ids = torch.full((len(texts), width), tokenizer.pad_token_id, dtype=torch.long)
    for i, e in enumerate(encoded):
        ids[i, : len(e)] = torch.tensor(e)
    return BatchedDataDict(input_ids=ids, input_lengths=torch.tensor([len(e) for e in encoded]))


def run(model, tokenizer, data, greedy=True, stop_strings=None, **cfg):
    settings = gen.SamplingSettings.from_config(GenerationConfig(**{"max_new_tokens": 12, **cfg}), tokenizer, greedy)
    with torch.no_grad():
        return gen.generate(model, data, settings, tokenizer, stop_strings, torch.device("cpu"))


def test_left_pad_round_trip():
    ids = torch.tensor([[5, 6, 7], [8, 9, 0]])
    left, mask = gen.left_pad(ids, torch.tensor([3, 2]), pad_id=0)
    assert left.tolist() == [[5, 6, 7], [0, 8, 9]] and mask.tolist() == [[1, 1, 1], [0, 1, 1]]


def test_batched_greedy_equals_one_prompt_at_a_time(hf_model, tiny_tokenizer):
    """Left padding inside a batch changes nothing: same tokens as unbatched HF generate, logprobs = forward."""
    data = prompts(tiny_tokenizer, ["<s>hello there", "<s>a", "<s>what is 2+2?"])
    out = run(hf_model, tiny_tokenizer, data)
    assert not generation_output_problems(data["input_ids"], data["input_lengths"], out, 12, 0)
    for i, length in enumerate(data["input_lengths"].tolist()):
        alone = hf_model.generate(
            data["input_ids"][i : i + 1, :length],
            attention_mask=torch.ones(1, length).long(),
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=2,
            pad_token_id=0,
        )
        n = int(out["generation_lengths"][i])
        assert out["output_ids"][i, length : length + n].tolist() == alone[0, length : length + n].tolist()
    with torch.no_grad():
        expected = hf_token_logprobs(
            hf_model, {"input_ids": out["output_ids"], "input_lengths": out["unpadded_sequence_lengths"]}
        )
    generated = torch.arange(out["output_ids"].shape[1])[None] >= data["input_lengths"][:, None]
    assert float(((out["logprobs"] - expected).abs() * generated).max()) <= 1e-5


def test_generation_batch_size_bounds_each_generate_call(hf_model, tiny_tokenizer, monkeypatch):
    """policy.generation_batch_size: prompts go through HF generate at most that many at a time, and
    the result is the same as all at once (greedy, per-sample stop strings kept with their rows)."""
    data = prompts(tiny_tokenizer, ["<s>hello there", "<s>a", "<s>what is 2+2?", "<s>b", "<s>cc"])
    data["stop_strings"] = [None, ["x"], None, None, ["q"]]
    settings = gen.SamplingSettings.from_config(GenerationConfig(max_new_tokens=8), tiny_tokenizer, True)
    sizes, real = [], gen.generate
    monkeypatch.setattr(gen, "generate", lambda model, d, *a: sizes.append(d.size) or real(model, d, *a))
    with torch.no_grad():
        whole = gen.generate_in_batches(hf_model, data, settings, tiny_tokenizer, None, torch.device("cpu"), None)
        batched = gen.generate_in_batches(hf_model, data, settings, tiny_tokenizer, None, torch.device("cpu"), 2)
    assert sizes == [5, 2, 2, 1]
    for key in whole:
        torch.testing.assert_close(batched[key], whole[key], atol=1e-5, rtol=0)


def test_stop_strings_global_and_per_sample_cut_at_the_first_occurrence(hf_model, tiny_tokenizer):
    data = prompts(tiny_tokenizer, ["<s>hello there", "<s>what is 2+2?"])
    free = run(hf_model, tiny_tokenizer, data)
    texts = [
        tiny_tokenizer.decode(
            free["output_ids"][i, int(data["input_lengths"][i]) : int(free["unpadded_sequence_lengths"][i])].tolist()
        )
        for i in range(2)
    ]
    # Stop strings taken from the free-running completions: row 0 by a global one, row 1 by its own.
    global_stop, row_stop = texts[0][3:5], texts[1][6:8]
    data["stop_strings"] = [None, [row_stop]]
    out = run(hf_model, tiny_tokenizer, data, stop_strings=[global_stop])
    for i, stop in enumerate([global_stop, row_stop]):
        length = int(data["input_lengths"][i])
        text = tiny_tokenizer.decode(out["output_ids"][i, length : int(out["unpadded_sequence_lengths"][i])].tolist())
        assert text.endswith(stop) and text.count(stop) == 1 and texts[i].startswith(text), (text, stop)
        assert not out["truncated"][i]
    assert not generation_output_problems(data["input_ids"], data["input_lengths"], out, 12, 0)


def test_stop_token_ids_end_a_row_and_are_kept(hf_model, tiny_tokenizer):
    data = prompts(tiny_tokenizer, ["<s>hello there"])
    free = run(hf_model, tiny_tokenizer, data)
    length = int(data["input_lengths"][0])
    stop_token = int(free["output_ids"][0, length + 4])
    first = free["output_ids"][0, length : length + 12].tolist().index(stop_token)
    out = run(hf_model, tiny_tokenizer, data, stop_token_ids=[stop_token])
    assert int(out["generation_lengths"][0]) == first + 1
    assert int(out["output_ids"][0, length + first]) == stop_token and not out["truncated"][0]
    assert bool(free["truncated"][0])


def test_sampling_settings_disable_what_is_unset_and_scale_logprobs(hf_model, tiny_tokenizer):
    settings = gen.SamplingSettings.from_config(GenerationConfig(temperature=0.7), tiny_tokenizer, greedy=False)
    hf_cfg = settings.hf_generation_config()
    assert hf_cfg.top_k == 0 and hf_cfg.do_sample and settings.logprob_temperature == 0.7
    assert settings.stop_token_ids == (tiny_tokenizer.eos_token_id,) and settings.pad_token_id == 0
    greedy = gen.SamplingSettings.from_config(GenerationConfig(temperature=0.7), tiny_tokenizer, greedy=True)
    assert not greedy.hf_generation_config().do_sample and greedy.logprob_temperature == 1.0

    torch.manual_seed(0)
    data = prompts(tiny_tokenizer, ["<s>hello there", "<s>hi"])
    out = run(hf_model, tiny_tokenizer, data, greedy=False, temperature=0.7)
    with torch.no_grad():
        ids, lens = out["output_ids"], out["unpadded_sequence_lengths"]
        valid = torch.arange(ids.shape[1])[None] < lens[:, None]
        logits = hf_model(input_ids=ids, attention_mask=valid.long()).logits[:, :-1].float() / 0.7
        scaled = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    generated = (torch.arange(1, ids.shape[1])[None] >= data["input_lengths"][:, None]) & valid[:, 1:]
    assert float(((out["logprobs"][:, 1:] - scaled).abs() * generated).max()) <= 1e-5


@pytest.mark.parametrize("tied", [False, True])
def test_param_layout_names_follow_the_hf_state_dict(tied):
    from transformers import AutoModelForCausalLM

    from rlcore.testing.models import tiny_model_path

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path(arch="qwen2", tie_word_embeddings=tied))
    layout = ParamLayout.from_model(model)
    state = model.state_dict()
    assert layout.names == [n for n in state if not (tied and n == "lm_head.weight")]
    assert layout.tied == ({"lm_head.weight": "model.embed_tokens.weight"} if tied else {})
    assert all(layout.shapes[n] == tuple(state[n].shape) for n in layout.names)
    assert {c.__name__ for c in decoder_layer_classes(model)} == {"Qwen2DecoderLayer"}


def test_clean_names_and_cpu_offload_note(hf_model):
    assert (
        clean_name("_fsdp_wrapped_module.model.layers.0._fsdp_wrapped_module._checkpoint_wrapped_module.mlp")
        == "model.layers.0.mlp"
    )
    kwargs, notes = fsdp_kwargs(hf_model, torch.device("cpu"), "bfloat16", offload=True)
    assert kwargs["cpu_offload"] is None and "no effect on CPU" in notes[0]
    assert kwargs["mixed_precision"].param_dtype == torch.bfloat16
    assert kwargs["mixed_precision"].reduce_dtype == torch.float32


_REPOINT_ONE_RANK_MODEL = r"""
import sys, torch, torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from transformers import AutoModelForCausalLM
from rl_fsdp1.sharding import fsdp_kwargs, repoint_unsharded_views

dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
hf = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
kwargs, _ = fsdp_kwargs(hf, torch.device("cpu"), "float32", False)
model = FSDP(hf, **kwargs)
with torch.no_grad():
    model(input_ids=torch.tensor([[5, 6, 7]]))
    for flat in model.parameters():  # what a move to another device does to each flat parameter
        flat.data = flat._local_shard = flat.data.clone()
if sys.argv[2] == "repoint":
    repoint_unsharded_views(model)
storages = {flat.untyped_storage().data_ptr() for flat in model.parameters()}
stale = [f"{type(m).__name__}.{name}" for m in model.modules() for name, value in vars(m).items()
         if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter)
         and value.untyped_storage().data_ptr() not in storages]
dist.destroy_process_group()
print(len(stale))
"""


@pytest.mark.parametrize("repoint, stale", [("repoint", False), ("no", True)])
def test_one_rank_module_weights_follow_a_moved_flat_parameter(tiny_model_dir, repoint, stale):
    """With one rank FSDP1 does not shard, and the modules' weights stay views of the flat parameter
    between passes: after a move they must be re-pointed, or they keep the old storage alive (on a
    GPU: an offload that frees nothing). Without the re-pointing the stale views are seen here."""
    import subprocess
    import sys

    child = subprocess.run(
        [sys.executable, "-c", _REPOINT_ONE_RANK_MODEL, tiny_model_dir, repoint],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    assert (int(child.stdout.split()[-1]) > 0) == stale, child.stdout
