"""The core training loop reads the device to the host once per optimizer step, not once per micro-batch.

On a GPU every ``.cpu()`` / ``float(t)`` / ``.item()`` / ``.tolist()`` of a device tensor waits for the
queued kernels: one per micro-batch stalls the stream between micro-batches. The loop sums the step loss on
the loss's device and reads a loss's tensor-valued metrics in one copy at the step's end
(:func:`rlcore.training.loop.host_values`). Counted here on CPU tensors by wrapping those methods; the numbers
are checked against a float64 recomputation.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rlcore.data import BatchedDataDict
from rlcore.training.loop import StepHooks, host_values, train_steps

READS = ("cpu", "item", "tolist", "__float__")


class TensorMetricsLoss:
    """Mean negative logprob over the step's valid tokens, with its metrics left as 0-dim tensors."""

    loss_type = "token_level"

    def __call__(self, logprobs: torch.Tensor, data: Any, global_seqs: torch.Tensor,
                 global_toks: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        mask = data["token_mask"][:, 1:].float() * data["sample_mask"][:, None].float()
        loss = -(logprobs[:, 1:] * mask).sum() / global_toks
        return loss, {"loss": loss.detach(), "num_valid_tokens": mask.sum(), "rows": float(mask.shape[0])}


def batch(rows: int, width: int = 6) -> BatchedDataDict:
    gen = torch.Generator().manual_seed(rows)
    lengths = torch.randint(2, width + 1, (rows,), generator=gen)
    token_mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    return BatchedDataDict({"input_ids": torch.randint(0, 50, (rows, width), generator=gen),
                            "input_lengths": lengths, "token_mask": token_mask,
                            "sample_mask": torch.ones(rows)})


def hooks(weight: torch.nn.Parameter) -> StepHooks:
    def forward(mb: BatchedDataDict) -> torch.Tensor:
        return torch.log_softmax(weight[mb["input_ids"]], dim=-1)[..., 0]

    return StepHooks(forward=forward, all_reduce_sum=lambda t: None, finish_grads=lambda: None,
                     clip_grads=lambda max_norm: 0.0, optimizer_step=lambda: None, zero_grad=lambda: None)


def counted_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    reads: list[str] = []
    for name in READS:
        original = getattr(torch.Tensor, name)

        def wrapped(self: torch.Tensor, *args: Any, _name: str = name, _original: Any = original, **kw: Any) -> Any:
            reads.append(_name)
            return _original(self, *args, **kw)
        monkeypatch.setattr(torch.Tensor, name, wrapped)
    return reads


def one_step(monkeypatch: pytest.MonkeyPatch, micro_batches: int) -> tuple[list[str], dict[str, Any], float]:
    """One optimizer step of 8 rows in ``micro_batches`` micro-batches: the host reads made during it, the
    loop's result, and the step loss recomputed in float64."""
    weight = torch.nn.Parameter(torch.randn(50, 3, generator=torch.Generator().manual_seed(0)))
    data = batch(8)
    reads = counted_reads(monkeypatch)
    result = train_steps(data, TensorMetricsLoss(), hooks(weight), local_batch_size=8, mbs=8 // micro_batches,
                         max_grad_norm=None)
    monkeypatch.undo()
    lp = torch.log_softmax(weight.detach().double()[data["input_ids"]], dim=-1)[..., 0]
    mask = data["token_mask"][:, 1:].double()
    return reads, result, float(-(lp[:, 1:] * mask).sum() / mask.sum())


def test_a_step_reads_the_host_the_same_number_of_times_whatever_its_micro_batches(monkeypatch) -> None:
    one, _, _ = one_step(monkeypatch, 1)
    for k in (2, 4, 8):
        reads, result, expected = one_step(monkeypatch, k)
        assert sorted(reads) == sorted(one), (k, reads, one)  # no read per micro-batch
        assert result["losses"] == [pytest.approx(expected, rel=1e-6)]
        metrics = result["all_mb_metrics"]  # every micro-batch's value, in order, as floats
        assert len(metrics["loss"]) == k and sum(metrics["loss"]) == pytest.approx(expected, rel=1e-6)
        assert metrics["rows"] == [8 / k] * k and all(type(v) is float for v in metrics["num_valid_tokens"])
        assert sum(metrics["num_valid_tokens"]) == sum(int(n) - 1 for n in batch(8)["input_lengths"])
    assert len(one) <= 6, one  # the counts' split, the step loss, its finiteness, the metrics in one copy


def test_host_values_reads_numbers_and_tensors_in_order() -> None:
    values = [1, torch.tensor(2.5), 3.0, torch.tensor([4.0]), torch.tensor(5, dtype=torch.int64)]
    assert host_values(values, [2, 3]) == [[1.0, 2.5], [3.0, 4.0, 5.0]]
    assert host_values([], []) == []
