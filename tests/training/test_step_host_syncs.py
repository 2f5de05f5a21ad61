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

    def __call__(
        self, logprobs: torch.Tensor, data: Any, global_seqs: torch.Tensor, global_toks: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        mask = data["token_mask"][:, 1:].float() * data["sample_mask"][:, None].float()
        loss = -(logprobs[:, 1:] * mask).sum() / global_toks
        return loss, {"loss": loss.detach(), "num_valid_tokens": mask.sum(), "rows": float(mask.shape[0])}


def batch(rows: int, width: int = 6) -> BatchedDataDict:
    gen = torch.Generator().manual_seed(rows)
    lengths = torch.randint(2, width + 1, (rows,), generator=gen)
    token_mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    data = BatchedDataDict(
        {
            "input_ids": torch.randint(0, 50, (rows, width), generator=gen),
            "input_lengths": lengths,
            "token_mask": token_mask,
            "sample_mask": torch.ones(rows),
        }
    )
    for key in ("advantages", "prev_logprobs", "generation_logprobs", "reference_policy_logprobs"):
        data[key] = (
            torch.randn(rows, width, generator=gen) if key == "advantages" else -torch.rand(rows, width, generator=gen)
        )  # what the clipped PG loss reads
    return data


def hooks(weight: torch.nn.Parameter) -> StepHooks:
    def forward(mb: BatchedDataDict) -> torch.Tensor:
        return torch.log_softmax(weight[mb["input_ids"]], dim=-1)[..., 0]

    return StepHooks(
        forward=forward,
        all_reduce_sum=lambda t: None,
        finish_grads=lambda: None,
        clip_grads=lambda max_norm: 0.0,
        optimizer_step=lambda: None,
        zero_grad=lambda: None,
    )


def counted_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    reads: list[str] = []
    for name in READS:
        original = getattr(torch.Tensor, name)

        def wrapped(self: torch.Tensor, *args: Any, _name: str = name, _original: Any = original, **kw: Any) -> Any:
            reads.append(_name)
            return _original(self, *args, **kw)

        monkeypatch.setattr(torch.Tensor, name, wrapped)
    return reads


def one_step(
    monkeypatch: pytest.MonkeyPatch, micro_batches: int, loss_fn: Any = None
) -> tuple[list[str], dict[str, Any], float]:
    """One optimizer step of 8 rows in ``micro_batches`` micro-batches: the host reads made during it, the
    loop's result, and the step loss of :class:`TensorMetricsLoss` recomputed in float64."""
    weight = torch.nn.Parameter(torch.randn(50, 3, generator=torch.Generator().manual_seed(0)))
    data = batch(8)
    reads = counted_reads(monkeypatch)
    result = train_steps(
        data,
        loss_fn or TensorMetricsLoss(),
        hooks(weight),
        local_batch_size=8,
        mbs=8 // micro_batches,
        max_grad_norm=None,
    )
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


def first_party_losses() -> dict[str, Any]:
    from rlcore.algorithms.loss_functions import ClippedPGLossFn, NLLLoss

    return {"clipped_pg": ClippedPGLossFn({"reference_policy_kl_penalty": 0.1}), "nll": NLLLoss()}


@pytest.mark.parametrize("name", ["clipped_pg", "nll"])
def test_a_first_party_loss_step_reads_the_host_the_same_number_of_times_whatever_its_micro_batches(
    monkeypatch, name
) -> None:
    one, whole, _ = one_step(monkeypatch, 1, first_party_losses()[name])
    for k in (2, 4):
        reads, result, _ = one_step(monkeypatch, k, first_party_losses()[name])
        assert sorted(reads) == sorted(one), (k, reads, one)
        assert result["losses"] == [pytest.approx(whole["losses"][0], rel=1e-6)]
        metrics = result["all_mb_metrics"]
        assert len(metrics["loss"]) == k and all(type(v) is float for vs in metrics.values() for v in vs)
        assert sum(metrics["loss"]) == pytest.approx(result["losses"][0], rel=1e-6)
        assert sum(metrics["num_valid_tokens"]) == sum(whole["all_mb_metrics"]["num_valid_tokens"])


def test_first_party_losses_read_nothing_and_the_loop_reads_the_floats_they_used_to_return(monkeypatch) -> None:
    """The losses return detached 0-dim tensors (no device sync inside a micro-batch); the loop's float64 read
    of each is the float the loss returned before (``float(t)``, or ``t.double().tolist()``), bit for bit."""
    from rlcore.algorithms.distillation import TEACHER_LOGITS_KEY, DistillationLossFn
    from rlcore.interfaces.loss import LOGITS_AT_INDICES

    data = batch(4)
    gen = torch.Generator().manual_seed(3)
    data[LOGITS_AT_INDICES] = torch.randn(4, 6, 3, generator=gen)
    data[TEACHER_LOGITS_KEY] = torch.randn(4, 6, 3, generator=gen)
    toks = (data["token_mask"][:, 1:] * data["sample_mask"][:, None]).sum()
    logprobs = -torch.rand(4, 6, generator=gen)
    for name, loss_fn in {**first_party_losses(), "distillation": DistillationLossFn({"kl_type": "mixed"})}.items():
        reads = counted_reads(monkeypatch)
        _, metrics = loss_fn(logprobs.clone().requires_grad_(), data, torch.tensor(4.0), toks)
        monkeypatch.undo()
        assert reads == [], (name, reads)
        assert all(isinstance(v, torch.Tensor) and v.dim() == 0 and not v.requires_grad for v in metrics.values())
        assert host_values(list(metrics.values()), [len(metrics)]) == [[float(v) for v in metrics.values()]]


def test_host_values_casts_once_per_dtype_not_once_per_value() -> None:
    """A step's metrics are cast to float64 in one copy per dtype (here float32 and int64): 2 copies for 4 or for 16
    values, where a cast per value made 4 and 16 (``aten::copy_`` counted by the profiler)."""

    def copies(n: int) -> tuple[int, list[list[float]]]:
        values = [torch.tensor(0.25 * i) if i % 2 else torch.tensor(i) for i in range(n)]
        with torch.profiler.profile() as prof:
            out = host_values(values, [n])
        return sum(e.count for e in prof.key_averages() if e.key == "aten::copy_"), out

    for n in (4, 16):
        count, out = copies(n)
        assert count == 2 and out == [[0.25 * i if i % 2 else float(i) for i in range(n)]], (n, count)
