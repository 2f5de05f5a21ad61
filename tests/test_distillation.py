"""On-policy distillation's loss and the loss-input contract it rests on (plugin API 5): the KL against a float64
recomputation, the student's logits at the teacher's ids from a vocabulary split over a gloo group, and the
refusal of the loss where a backend cannot compute its input."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from rlcore.algorithms.distillation import TEACHER_LOGITS_KEY, DistillationLossFn
from rlcore.interfaces.loss import LOGIT_INDICES_KEY, LOGITS_AT_INDICES, loss_inputs
from rlcore.training.loss_inputs import logits_at_indices
from rlcore.training.vocab_parallel import vocab_parallel_gather


def _batch(seed: int = 0, batch: int = 3, seq: int = 7, k: int = 4) -> dict:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([7, 4, 5])[:batch]
    token_mask = (torch.arange(seq)[None, :] >= 2).float() * (torch.arange(seq)[None, :] < lengths[:, None])
    return {"input_lengths": lengths, "token_mask": token_mask, "sample_mask": torch.tensor([1.0, 1.0, 0.0]),
            LOGITS_AT_INDICES: torch.randn(batch, seq, k, generator=gen, dtype=torch.float64) * 2,
            TEACHER_LOGITS_KEY: torch.randn(batch, seq, k, generator=gen, dtype=torch.float64) * 2}


def _kl_float64(data: dict, kl_type: str, weight: float) -> torch.Tensor:
    """Per valid token: the KL of the two top-k-renormalised distributions, summed over tokens (float64)."""
    total = torch.zeros((), dtype=torch.float64)
    for b in range(data["input_lengths"].shape[0]):
        if not data["sample_mask"][b]:
            continue
        for t in range(1, int(data["input_lengths"][b])):
            if not data["token_mask"][b, t]:
                continue
            s = torch.softmax(data[LOGITS_AT_INDICES][b, t], -1)
            p = torch.softmax(data[TEACHER_LOGITS_KEY][b, t], -1)
            forward = (p * (p.log() - s.log())).sum()
            reverse = (s * (s.log() - p.log())).sum()
            w = {"forward": 1.0, "reverse": 0.0, "mixed": weight}[kl_type]
            total = total + w * forward + (1 - w) * reverse
    return total


@pytest.mark.parametrize("kl_type, weight", [("forward", 0.5), ("reverse", 0.5), ("mixed", 0.3)])
def test_the_kl_and_its_gradient_match_a_float64_recomputation(kl_type, weight):
    data = _batch()
    student = data[LOGITS_AT_INDICES].clone().requires_grad_(True)
    loss, metrics = DistillationLossFn({"kl_type": kl_type, "mixed_kl_weight": weight})(
        torch.zeros(3, 7), {**data, LOGITS_AT_INDICES: student}, torch.tensor(2.0), torch.tensor(6.0))
    loss.backward()
    reference = data[LOGITS_AT_INDICES].clone().requires_grad_(True)
    expected = _kl_float64({**data, LOGITS_AT_INDICES: reference}, kl_type, weight) / 6.0
    expected.backward()
    assert abs(float(loss) - float(expected)) < 1e-6  # float32 arithmetic on float64 inputs
    assert (student.grad.double() - reference.grad).abs().max() < 1e-6
    assert metrics["num_valid_tokens"] == float((data["token_mask"][:2, 1:]).sum())
    if kl_type != "mixed":
        assert metrics[f"{kl_type}_kl"] == pytest.approx(float(expected), rel=1e-5)


def test_scoring_outside_the_top_k_is_refused_not_ignored():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="zero_outside_topk=true is not offered"):
        DistillationLossFn({"zero_outside_topk": True})


def test_a_loss_input_rlcore_does_not_know_is_refused():
    class Odd:
        inputs = ("hidden_states",)

    assert loss_inputs(DistillationLossFn()) == (LOGITS_AT_INDICES,)
    with pytest.raises(ValueError, match=r"Odd.inputs names \['hidden_states'\]; a loss may ask for "
                                         "logits_at_indices"):
        loss_inputs(Odd())


def test_logits_at_indices_take_the_previous_position_and_zero_padding():
    logits = torch.randn(2, 5, 11, dtype=torch.float64)
    indices = torch.randint(0, 11, (2, 5, 3))
    data = {LOGIT_INDICES_KEY: indices, "input_lengths": torch.tensor([5, 3])}
    out = logits_at_indices(logits, data)
    assert out.shape == (2, 5, 3) and out.dtype == torch.float32
    for b, length in ((0, 5), (1, 3)):
        for t in range(5):
            want = logits[b, t - 1, indices[b, t]].float() if 1 <= t < length else torch.zeros(3)
            assert torch.equal(out[b, t], want), (b, t)


def _split_vocab_rank(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        gen = torch.Generator().manual_seed(3)
        full = torch.randn(2, 6, 37, generator=gen)
        indices = torch.randint(0, 37, (2, 6, 5), generator=gen)
        weights = torch.randn(2, 6, 5, generator=gen)
        bounds = [0, 19, 37]  # uneven slices, as a padded vocabulary gives
        local = full[..., bounds[rank]:bounds[rank + 1]].clone().requires_grad_(True)
        values = vocab_parallel_gather(local, indices, bounds[rank], dist.group.WORLD)
        (grad,) = torch.autograd.grad((values * weights).sum(), local)
        torch.save({"values": values, "grad": grad}, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_a_vocabulary_split_over_a_gloo_group_gives_the_whole_vocabulary_s_logits(tmp_path: Path) -> None:
    mp.start_processes(_split_vocab_rank, args=(2, f"file://{tmp_path / 'rendezvous'}", str(tmp_path)), nprocs=2,
                       start_method="spawn")
    gen = torch.Generator().manual_seed(3)
    full = torch.randn(2, 6, 37, generator=gen).requires_grad_(True)
    indices = torch.randint(0, 37, (2, 6, 5), generator=gen)
    weights = torch.randn(2, 6, 5, generator=gen)
    expected = full.gather(-1, indices)
    (expected_grad,) = torch.autograd.grad((expected * weights).sum(), full)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    for rank in ranks:  # every rank holds every id's logit
        assert torch.equal(rank["values"], expected.detach())
    grad = torch.cat([rank["grad"] for rank in ranks], dim=-1)  # each rank's slice of the gradient
    assert (grad - expected_grad).abs().max() < 1e-6
