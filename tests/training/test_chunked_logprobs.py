"""``policy.logprob_chunk_size``: logprobs a chunk of positions at a time give the same values and gradients
as a float64 log-softmax over the whole vocabulary, on one rank and with the vocabulary split over a real
gloo group; a backend without the capability is refused by name. The backends' own runs are the conformance
kit's ``chunked`` variant (logprobs against a float64 HF forward, steps against the single-process oracle)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from rlcore.training.chunked_logprobs import chunked_logprobs


def _reference(
    full: torch.Tensor, target: torch.Tensor, weights: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 values and gradient (w.r.t. ``full``) of ``sum(weights * log_softmax(full[:, :-1] / T)[target])``."""
    full = full.detach().double().requires_grad_(True)
    values = (full[:, :-1] / temperature).log_softmax(-1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    (grad,) = torch.autograd.grad((values * weights).sum(), full)
    return values.detach(), grad


def _case(vocab: int = 37, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    full = torch.randn(3, 11, vocab, generator=gen) * 3
    return full, torch.randint(0, vocab, (3, 10), generator=gen), torch.randn(3, 10, generator=gen, dtype=torch.float64)


@pytest.mark.parametrize("chunk", [1, 4, 10, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_chunks_give_the_float64_values_and_gradient(chunk: int, temperature: float) -> None:
    full, target, weights = _case()
    expected, expected_grad = _reference(full, target, weights, temperature)
    logits = full.clone().requires_grad_(True)
    values = chunked_logprobs(logits[:, :-1], target, chunk, temperature=temperature)  # a non-contiguous view
    (grad,) = torch.autograd.grad((values.double() * weights).sum(), logits)
    assert torch.equal(logits.detach(), full)  # float32 logits are worked on in copies, never in place
    assert values.dtype == torch.float32 and values.shape == target.shape
    assert (values.double() - expected).abs().max() < 1e-5
    assert (grad.double() - expected_grad).abs().max() < 1e-5
    assert grad[:, -1].abs().max() == 0  # the last position predicts nothing here


def test_the_gradient_keeps_the_logits_dtype() -> None:
    full, target, weights = _case()
    logits = full.to(torch.bfloat16).requires_grad_(True)
    values = chunked_logprobs(logits, torch.cat([target, target[:, :1]], 1), 4)
    values.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    expected = logits.detach().double().log_softmax(-1).gather(-1, torch.cat([target, target[:, :1]], 1)[..., None])
    assert (values.double() - expected.squeeze(-1)).abs().max() < 1e-5  # float32 arithmetic on bf16 inputs


def test_a_chunk_size_below_one_is_refused() -> None:
    full, target, _ = _case()
    with pytest.raises(ValueError, match="positive number of positions, got 0"):
        chunked_logprobs(full[:, :-1], target, 0)


def _split_vocab_rank(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        full, target, weights = _case(vocab=37, seed=1)
        bounds = [0, 19, 37]  # uneven slices, as a padded vocabulary gives
        local = full[:, :-1, bounds[rank] : bounds[rank + 1]].clone().requires_grad_(True)
        values = chunked_logprobs(local, target, 4, vocab_start=bounds[rank], group=dist.group.WORLD, temperature=0.8)
        (grad,) = torch.autograd.grad((values.double() * weights).sum(), local)
        torch.save({"values": values, "grad": grad}, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_a_vocabulary_split_over_a_gloo_group_gives_the_whole_vocabulary_s_numbers(tmp_path: Path) -> None:
    mp.start_processes(
        _split_vocab_rank, args=(2, f"file://{tmp_path / 'rendezvous'}", str(tmp_path)), nprocs=2, start_method="spawn"
    )
    full, target, weights = _case(vocab=37, seed=1)
    expected, expected_grad = _reference(full, target, weights, 0.8)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    for rank in ranks:  # every rank gets every position's logprob
        assert (rank["values"].double() - expected).abs().max() < 1e-5
    grad = torch.cat([rank["grad"] for rank in ranks], dim=-1)  # each rank's slice of the gradient
    assert (grad.double() - expected_grad[:, :-1]).abs().max() < 1e-5


def test_a_backend_without_the_capability_is_refused_by_name() -> None:
    from rlcore.config import ConfigError, load_config_dict, resolve

    cfg = load_config_dict({"policy": {"backend": "reference", "logprob_chunk_size": 4}})
    assert cfg.policy.logprob_chunk_size == 4
    from rlcore.config.backends import capability_problems
    from rlcore.plugins import BackendSpec

    spec = BackendSpec(
        name="older",
        kind="training",
        worker_class="older_pkg.worker:W",
        plugin_api_version=3,
        capabilities={"train", "logprobs"},
    )
    assert capability_problems(cfg.policy, spec, packing=False) == [
        "policy.logprob_chunk_size: the 'older' training backend does not declare 'chunked_logprobs'; remove it (null)"
    ]
    resolve(cfg)  # the built-in reference backend declares it
    with pytest.raises(ConfigError):
        load_config_dict({"policy": {"logprob_chunk_size": 0}})


@pytest.mark.gpu
def test_chunks_lower_the_peak_gpu_memory_and_keep_the_numbers() -> None:
    """On a GPU (where the memory matters): bf16 logits of 4096 positions x 32000 tokens; the chunked forward
    + backward peaks at less than half the whole computation's growth, with the same logprobs and gradient."""
    from rlcore.training.logprobs import token_logprobs

    results = {}
    for chunk in (None, 512):
        torch.manual_seed(0)  # the same logits and ids for both: only the chunking differs
        logits = torch.randn(1, 4096, 32000, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
        ids = torch.randint(0, 32000, (1, 4096), device="cuda")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        lp = token_logprobs(logits, ids, torch.tensor([4096]), chunk_size=chunk)
        lp.sum().backward()
        torch.cuda.synchronize()
        results[chunk] = (torch.cuda.max_memory_allocated() - base, lp.detach(), logits.grad.float())
        del logits, lp
    (whole, lp_whole, grad_whole), (chunked, lp_chunked, grad_chunked) = results[None], results[512]
    print(f"peak growth: whole {whole / 2**20:.0f} MiB, chunks of 512 {chunked / 2**20:.0f} MiB")
    assert chunked < 0.5 * whole
    assert (lp_whole - lp_chunked).abs().max() < 1e-4
    assert (grad_whole - grad_chunked).abs().max() < 1e-3  # bf16 gradients: one rounding apart at most


def graph_names(tensor: torch.Tensor) -> set[str]:
    """Names of the autograd nodes that produced ``tensor``."""
    names, todo = set(), [tensor.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and type(node).__name__ not in names:
            names.add(type(node).__name__)
            todo += [next_node for next_node, _ in node.next_functions]
    return names


def test_the_workers_logprob_function_takes_the_chunked_path_only_when_asked() -> None:
    """``token_logprobs`` (what the reference and fsdp1 workers call with ``policy.logprob_chunk_size``)."""
    from rlcore.training.logprobs import token_logprobs

    full, target, _ = _case()
    ids = torch.cat([target[:, :1], target], dim=1)
    lengths = torch.tensor([11, 7, 1])
    logits = full.clone().requires_grad_(True)
    whole = token_logprobs(logits, ids, lengths, temperature=0.7)
    chunked = token_logprobs(logits, ids, lengths, temperature=0.7, chunk_size=4)
    assert "ChunkedLogprobBackward" in graph_names(chunked) and "ChunkedLogprobBackward" not in graph_names(whole)
    assert (whole - chunked).abs().max() < 1e-5 and (chunked[2] == 0).all()  # padding stays 0
