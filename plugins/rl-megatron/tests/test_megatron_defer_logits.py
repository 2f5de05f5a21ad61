"""``policy.megatron_cfg.defer_fp32_logits``: bf16 logits kept in bf16 until the logprob maths must give the numbers
of logits cast to float32 at once (the default), and both the float64 log-softmax of the same bf16 values.

On CPU megatron trains in float32 only (its mixed-precision optimizer needs CUDA), so the bf16 logits here are what
a bf16 GPU run's output layer gives: the functions under test are the worker's own
(:func:`rl_megatron.pipeline.logits_for_loss`, :func:`rl_megatron.vocab_parallel.token_logprobs`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from rl_megatron.pipeline import logits_for_loss
from rl_megatron.vocab_parallel import token_logprobs

VOCAB, COLUMNS = 61, 64  # a vocabulary padded to 64 columns, as megatron pads it for tensor parallelism


@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The vocabulary-parallel logprob reduces over a group; here one gloo rank (the whole vocabulary)."""
    import torch.distributed as dist

    store = Path(tmp_path_factory.mktemp("gloo")) / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize("chunk_size", [None, 3])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_deferred_bf16_logits_give_the_float32_numbers(chunk_size: int | None, temperature: float) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = (4 * torch.randn(3, 11, COLUMNS, generator=gen, dtype=torch.float64)).to(torch.bfloat16)
    ids = torch.randint(0, VOCAB, (3, 11), generator=gen)

    deferred = logits_for_loss(logits, defer_fp32_logits=True)
    eager = logits_for_loss(logits, defer_fp32_logits=False)
    assert (deferred.dtype, eager.dtype) == (torch.bfloat16, torch.float32)

    got = token_logprobs(deferred, ids, 0, VOCAB, None, temperature, chunk_size)
    expected = token_logprobs(eager, ids, 0, VOCAB, None, temperature, chunk_size)
    assert got.dtype == torch.float32
    assert torch.equal(got, expected)
    reference = (logits[:, :-1, :VOCAB].double() / temperature).log_softmax(-1).gather(-1, ids[:, 1:, None])
    assert float((got.double() - reference.squeeze(-1)).abs().max()) < 2e-5
