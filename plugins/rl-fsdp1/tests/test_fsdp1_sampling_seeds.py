"""Per-request sampling seeds in fsdp1's HF generate (``sampling_seeds``, issue 52 item 4): each row is sampled
from a generator of its own, so its completion depends on its seed and the weights only, and the sampling is
HF's own (the same tokens HF's ``do_sample`` draws from a generator seeded the same)."""

from __future__ import annotations

import pytest
import torch

from rl_fsdp1 import generation as gen
from rlcore.config.generation import GenerationConfig
from rlcore.data import BatchedDataDict
from rlcore.testing.conformance import load_hf_model

SAMPLING = {"temperature": 0.7, "top_k": 20, "top_p": 0.9, "max_new_tokens": 12}


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    return load_hf_model(tiny_model_dir).eval()


def prompts(tokenizer, texts: list[str], seeds: list[int] | None) -> BatchedDataDict:
    encoded = [tokenizer.encode(t) for t in texts]
    width = max(len(e) for e in encoded)
    ids = torch.full((len(texts), width), tokenizer.pad_token_id, dtype=torch.long)
    for i, e in enumerate(encoded):
        ids[i, : len(e)] = torch.tensor(e)
    data = BatchedDataDict(input_ids=ids, input_lengths=torch.tensor([len(e) for e in encoded]))
    if seeds is not None:
        data["sampling_seeds"] = torch.tensor(seeds, dtype=torch.long)
    return data


def sample(model, tokenizer, data):
    settings = gen.SamplingSettings.from_config(GenerationConfig(**SAMPLING), tokenizer, greedy=False)
    with torch.no_grad():
        return gen.generate(model, data, settings, tokenizer, None, torch.device("cpu"))


def completion(out, row: int) -> list[int]:
    start, n = int(out["unpadded_sequence_lengths"][row] - out["generation_lengths"][row]), out["generation_lengths"]
    return out["output_ids"][row, start : start + int(n[row])].tolist()


def test_a_seeded_row_draws_what_hf_sampling_draws_from_a_generator_seeded_the_same(hf_model, tiny_tokenizer):
    """The reference: HF's own do_sample (its temperature, top-k and top-p warpers, its multinomial) on one
    prompt with torch's generator seeded with the row's seed."""
    data = prompts(tiny_tokenizer, ["<s>hello there"], [12345])
    ours = completion(sample(hf_model, tiny_tokenizer, data), 0)
    torch.manual_seed(12345)
    length = int(data["input_lengths"][0])
    with torch.no_grad():
        reference = hf_model.generate(
            data["input_ids"][:, :length],
            attention_mask=torch.ones(1, length).long(),
            do_sample=True,
            eos_token_id=tiny_tokenizer.eos_token_id,
            pad_token_id=0,
            **SAMPLING,
        )
    assert ours == reference[0, length : length + len(ours)].tolist() and len(ours) > 0


def test_a_row_s_completion_depends_on_its_seed_alone(hf_model, tiny_tokenizer):
    """Not on the rows beside it, nor on what torch's generator drew before; another seed samples another
    completion; the logprobs are still the temperature-scaled forward's (design.md §2.2)."""
    texts = ["<s>hello there", "<s>a", "<s>what is 2+2?"]
    torch.manual_seed(0)
    batch = sample(hf_model, tiny_tokenizer, prompts(tiny_tokenizer, texts, [7, 8, 9]))
    torch.rand(100)
    alone = sample(hf_model, tiny_tokenizer, prompts(tiny_tokenizer, texts[1:2], [8]))
    assert completion(batch, 1) == completion(alone, 0)
    again = sample(hf_model, tiny_tokenizer, prompts(tiny_tokenizer, texts, [7, 8, 9]))
    assert torch.equal(again["output_ids"], batch["output_ids"]) and torch.equal(again["logprobs"], batch["logprobs"])
    other = sample(hf_model, tiny_tokenizer, prompts(tiny_tokenizer, texts, [70, 80, 90]))
    assert not torch.equal(other["output_ids"], batch["output_ids"])
    with torch.no_grad():
        ids, lens = batch["output_ids"], batch["unpadded_sequence_lengths"]
        valid = torch.arange(ids.shape[1])[None] < lens[:, None]
        logits = hf_model(input_ids=ids, attention_mask=valid.long()).logits[:, :-1].float() / SAMPLING["temperature"]
        expected = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    generated = torch.arange(1, ids.shape[1])[None] >= prompts(tiny_tokenizer, texts, None)["input_lengths"][:, None]
    assert float(((batch["logprobs"][:, 1:] - expected).abs() * (generated & valid[:, 1:])).max()) <= 1e-5


def test_seeds_must_match_the_batch():
    data = BatchedDataDict(input_ids=torch.ones(2, 3, dtype=torch.long), input_lengths=torch.tensor([3, 3]))
    assert gen.row_seeds(data) is None
    data["sampling_seeds"] = torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match="sampling_seeds has 3 entries for a batch of 2"):
        gen.row_seeds(data)
