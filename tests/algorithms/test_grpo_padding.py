"""No GRPO pass computes padding past a micro-batch's own rows (issue 14).

A rollout is one tensor padded to its longest completion. Plain micro-batches are cut to their own
longest row; a GRPO run packs by default where the training backend can (``sequence_packing.enabled:
null``). That packed and plain passes give the same numbers is the conformance kit's ``packing``
variant; that cutting leaves the real tokens' logprobs alone is checked here against the uncut forward.
"""

from __future__ import annotations

import pytest
import torch

from rlcore.config import load_config, resolve
from rlcore.data import BatchedDataDict
from rlcore.training.loop import micro_batches


def ragged_batch(vocab_size: int = 300) -> BatchedDataDict:
    """Six right-padded rows of 4-12 tokens; the third sets the rollout's width (12)."""
    lengths = torch.tensor([4, 5, 12, 6, 4, 7])
    ids = torch.randint(1, vocab_size, (6, 12), generator=torch.Generator().manual_seed(3))
    real = torch.arange(12)[None, :] < lengths[:, None]
    return BatchedDataDict(
        input_ids=ids * real, input_lengths=lengths, token_mask=real.float(), sample_mask=torch.ones(6)
    )


def test_plain_micro_batches_are_cut_to_their_own_longest_row():
    data = ragged_batch()
    widths = [mb["input_ids"].shape[1] for mb in micro_batches(data, 2, "plain")]
    assert widths == [5, 12, 7]
    first = next(micro_batches(data, 2, "plain"))
    assert torch.equal(first["input_ids"], data["input_ids"][:2, :5])
    assert first["token_mask"].shape == (2, 5) and torch.equal(first["input_lengths"], torch.tensor([4, 5]))
    # make_sequence_length_divisible_by still holds after the cut
    assert [mb["input_ids"].shape[1] for mb in micro_batches(data, 2, "plain", multiple=4)] == [8, 12, 8]


def test_cutting_leaves_the_real_tokens_logprobs_alone(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from rlcore.training.logprobs import token_logprobs

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64).eval()
    data = ragged_batch(model.config.vocab_size)

    def logprobs(mb: BatchedDataDict) -> torch.Tensor:
        ids, lengths = mb["input_ids"], mb["input_lengths"]
        mask = (torch.arange(ids.shape[1])[None, :] < lengths[:, None]).long()
        with torch.no_grad():
            return token_logprobs(model(input_ids=ids, attention_mask=mask).logits.double(), ids, lengths)

    full = logprobs(data)
    for start, mb in zip((0, 2, 4), micro_batches(data, 2, "plain")):
        cut = logprobs(mb)
        assert cut.shape[1] < full.shape[1] or start == 2
        for row, n in enumerate(mb["input_lengths"].tolist()):
            torch.testing.assert_close(cut[row, 1:n], full[start + row, 1:n], rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "example, overrides, packs",
    [
        ("examples/grpo_tiny.yaml", [], True),  # dtensor packs
        ("examples/grpo_tiny.yaml", ["policy.sequence_packing.enabled=false"], False),  # the user's word stands
        ("examples/grpo_tiny.yaml", ["policy.dynamic_batching.enabled=true"], False),  # the two exclude each other
        ("examples/grpo_fsdp1.yaml", [], False),  # fsdp1 cannot pack
    ],
)
def test_a_grpo_run_packs_by_default_where_the_backend_can(example, overrides, packs):
    cfg = load_config(example, overrides)
    given = cfg.policy.sequence_packing.enabled
    resolved = resolve(cfg, run=True)
    assert resolved.config.policy.sequence_packing.enabled is packs
    assert resolved.policy.batch.mode == ("packing" if packs else "dynamic" if "dynamic" in str(overrides) else "plain")
    assert cfg.policy.sequence_packing.enabled is given  # the caller's config is not changed
