"""The per-request sampling seeds a vLLM generation batch may carry (``sampling_seeds``, issue 52 item 4): read
per request, checked against the batch on the driver, and forwarded to the engines with the other input keys."""

from __future__ import annotations

import pytest
import torch

from rl_vllm.generation import INPUT_KEYS
from rl_vllm.sampling import batch_problems, request_seeds


def batch(rows: int, **extra):
    return {"input_ids": torch.ones(rows, 3, dtype=torch.long), "input_lengths": torch.full((rows,), 3), **extra}


def test_each_request_gets_its_row_s_seed_and_none_without_the_key():
    assert request_seeds(batch(2), 2) == [None, None]  # the engine's own generator draws, as before
    seeds = torch.tensor([2**63 - 1, 0, 17], dtype=torch.long)  # a 63-bit seed survives as a Python int
    assert request_seeds(batch(3, sampling_seeds=seeds), 3) == [2**63 - 1, 0, 17]
    with pytest.raises(ValueError, match="sampling_seeds has 3 entries for a batch of 2"):
        request_seeds(batch(2, sampling_seeds=seeds), 2)


def test_a_seed_count_that_is_not_the_batch_s_is_refused_before_the_engines():
    assert batch_problems(batch(2, sampling_seeds=torch.tensor([1, 2]))) == []
    assert batch_problems(batch(2, sampling_seeds=torch.tensor([1, 2, 3]))) == [
        "sampling_seeds has 3 entries for a batch of 2"
    ]
    assert "sampling_seeds" in INPUT_KEYS  # the driver sends the key to the engines
