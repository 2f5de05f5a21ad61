"""On-policy distillation's loss and the loss-input contract it rests on (plugin API 5): the KL against a float64
recomputation, the student's logits at the teacher's ids (and zero_outside_topk's inputs) from a vocabulary split
over a gloo group, and the refusal of the loss where a backend cannot compute its input."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from rlcore.algorithms.distillation import TEACHER_LOGITS_KEY, DistillationLossFn
from rlcore.interfaces.loss import LOGIT_INDICES_KEY, LOGITS_AT_INDICES, loss_inputs
from rlcore.training.loss_inputs import logits_at_indices
from rlcore.training.vocab_parallel import vocab_parallel_entropy, vocab_parallel_gather, vocab_parallel_logprobs_at


def _batch(seed: int = 0, batch: int = 3, seq: int = 7, k: int = 4) -> dict:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([7, 4, 5])[:batch]
    token_mask = (torch.arange(seq)[None, :] >= 2).float() * (torch.arange(seq)[None, :] < lengths[:, None])
    return {
        "input_lengths": lengths,
        "token_mask": token_mask,
        "sample_mask": torch.tensor([1.0, 1.0, 0.0]),
        LOGITS_AT_INDICES: torch.randn(batch, seq, k, generator=gen, dtype=torch.float64) * 2,
        TEACHER_LOGITS_KEY: torch.randn(batch, seq, k, generator=gen, dtype=torch.float64) * 2,
    }


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
        torch.zeros(3, 7), {**data, LOGITS_AT_INDICES: student}, torch.tensor(2.0), torch.tensor(6.0)
    )
    loss.backward()
    reference = data[LOGITS_AT_INDICES].clone().requires_grad_(True)
    expected = _kl_float64({**data, LOGITS_AT_INDICES: reference}, kl_type, weight) / 6.0
    expected.backward()
    assert abs(float(loss) - float(expected)) < 1e-6  # float32 arithmetic on float64 inputs
    assert (student.grad.double() - reference.grad).abs().max() < 1e-6
    assert metrics["num_valid_tokens"] == float((data["token_mask"][:2, 1:]).sum())
    if kl_type != "mixed":
        assert metrics[f"{kl_type}_kl"] == pytest.approx(float(expected), rel=1e-5)


def test_a_loss_input_rlcore_does_not_know_is_refused():
    class Odd:
        inputs = ("hidden_states",)

    assert loss_inputs(DistillationLossFn()) == (LOGITS_AT_INDICES,)
    with pytest.raises(
        ValueError,
        match=r"Odd.inputs names \['hidden_states'\]; a loss may ask for "
        "logits_at_indices",
    ):
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


def _split_vocab(dtype: torch.dtype = torch.float32) -> tuple:
    """Logits with a padded vocabulary row (-inf, as megatron masks it), ids and weights of the split test."""
    gen = torch.Generator().manual_seed(3)
    full = torch.randn(2, 6, 37, generator=gen)
    full[..., 36] = float("-inf")
    indices = torch.randint(0, 36, (2, 6, 5), generator=gen)
    weights = torch.randn(3, 2, 6, 5, generator=gen)
    return full.to(dtype), indices, weights.to(dtype)


def _split_vocab_rank(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        full, indices, weights = _split_vocab()
        bounds = [0, 19, 37]  # uneven slices, as a padded vocabulary gives
        local = full[..., bounds[rank] : bounds[rank + 1]].clone().requires_grad_(True)
        values = vocab_parallel_gather(local, indices, bounds[rank], dist.group.WORLD)
        logprobs = vocab_parallel_logprobs_at(local, indices, bounds[rank], dist.group.WORLD)
        entropy = vocab_parallel_entropy(local, dist.group.WORLD)
        (grad,) = torch.autograd.grad((values * weights[0]).sum(), local)
        (full_grad,) = torch.autograd.grad((logprobs * weights[1]).sum() + (entropy * weights[2, ..., 0]).sum(), local)
        torch.save(
            {"values": values, "grad": grad, "logprobs": logprobs, "entropy": entropy, "full_grad": full_grad},
            f"{out}/rank{rank}.pt",
        )
    finally:
        dist.destroy_process_group()


def test_a_vocabulary_split_over_a_gloo_group_gives_the_whole_vocabulary_s_values(tmp_path: Path) -> None:
    """The logits at given ids, and (``zero_outside_topk``'s inputs) the full-vocabulary logprobs there and the
    entropy, with their gradients, from a vocabulary split unevenly over two gloo ranks (one spawn for all)."""
    mp.start_processes(
        _split_vocab_rank, args=(2, f"file://{tmp_path / 'rendezvous'}", str(tmp_path)), nprocs=2, start_method="spawn"
    )
    full, indices, weights = _split_vocab(torch.float64)
    full.requires_grad_(True)
    expected = full.gather(-1, indices)
    (expected_grad,) = torch.autograd.grad((expected * weights[0]).sum(), full)
    log_p = torch.log_softmax(full[..., :36], -1)  # the padded row carries no probability
    expected_lp = log_p.gather(-1, indices)
    expected_h = -(log_p.exp() * log_p).sum(-1)
    (expected_full_grad,) = torch.autograd.grad(
        (expected_lp * weights[1]).sum() + (expected_h * weights[2, ..., 0]).sum(), full
    )
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    for rank in ranks:  # every rank holds every id's logit, logprob and every position's entropy
        assert torch.equal(rank["values"], expected.detach().float())
        assert (rank["logprobs"].double() - expected_lp.detach()).abs().max() < 1e-5
        assert (rank["entropy"].double() - expected_h.detach()).abs().max() < 1e-5
    for key, want in (("grad", expected_grad), ("full_grad", expected_full_grad)):
        grad = torch.cat([rank[key] for rank in ranks], dim=-1)  # each rank's slice of the gradient
        assert torch.isfinite(grad).all(), key
        assert (grad.double() - want).abs().max() < 1e-5, key


def _distillation_config(tmp_path, **overrides):
    from rlcore.config import load_config

    base = {
        "cluster.workers_per_node": "1",
        "policy.backend": "fsdp1",
        "policy.generation.backend": "fsdp1",
        "policy.model_name": "tiny-llama",
        "policy.train_global_batch_size": "8",
        "policy.train_micro_batch_size": "2",
        "policy.dtensor_cfg.enabled": "false",
        "policy.max_total_sequence_length": "32",
        "policy.generation.max_new_tokens": "6",
        "distillation.teacher_model_name": "tiny-teacher",
        "distillation.topk_logits_k": "5",
        "distillation.num_prompts_per_step": "4",
        "distillation.num_generations_per_prompt": "2",
        "distillation.max_num_steps": "2",
        "logger.output_dir": str(tmp_path / "run"),
        "logger.progress_bar": "false",
        "checkpointing.enabled": "false",
        **overrides,
    }
    return load_config("examples/distill_tiny.yaml", [f"{k}={v}" for k, v in base.items()])


def test_a_student_backend_without_the_loss_input_is_refused_by_name(tmp_path, rlcore_registry):
    from rlcore.config import ConfigError, resolve
    from rlcore.plugins import BackendSpec, hookimpl

    class OlderPlugin:
        @hookimpl
        def rlcore_register_backends(self, register):
            register(
                BackendSpec(
                    name="older",
                    kind="training",
                    worker_class="rlcore.backends.reference.worker:ReferenceWorker",
                    plugin_api_version=4,
                    capabilities={"train", "logprobs", "topk_logits", "generate"},
                )
            )

    import rlcore.environments.plugin as environments

    rlcore_registry.register_plugin(OlderPlugin(), name="older")
    rlcore_registry.register_plugin(environments, name="environments")
    cfg = _distillation_config(tmp_path, **{"policy.backend": "older", "policy.generation.backend": "older"})
    with pytest.raises(
        ConfigError, match="distillation: the 'older' training backend does not declare 'logits_at_indices'"
    ):
        resolve(cfg, run=True, registry=rlcore_registry)


def test_the_student_trains_on_the_kl_to_the_teacher_s_top_k(ray_session, tmp_path):
    """A real student, engine and teacher: the student's loss on its own rollout, with the teacher's top-k from
    the teacher Policy, equals a float64 recomputation from both models' Hugging Face forwards."""
    from transformers import AutoModelForCausalLM

    from rlcore.algorithms.distillation import DistillationLossFn
    from rlcore.algorithms.distillation.loop import add_teacher_topk
    from rlcore.algorithms.distillation.token_mapping import TeacherTokens
    from rlcore.config import resolve
    from rlcore.run.build import build_run
    from rlcore.run.rollouts import run_rollout
    from rlcore.run.step import Timer, training_batch
    from tests.algorithms.test_distillation_cross_tokenizer import teacher_tokenizer

    resolved = resolve(_distillation_config(tmp_path), run=True)
    cfg = resolved.config
    run = build_run(resolved)
    try:
        samples = run.draw_train_batch()
        run.generation.prepare_for_generation()
        rollout = run_rollout(
            cfg, lambda b: run.generation.generate(b, greedy=False), run.environment, run.tokenizer, samples, 2, Timer()
        )
        run.generation.finish_generation()
        data = training_batch(rollout.data, torch.zeros_like(rollout.rewards))
        add_teacher_topk(run.teacher, data, 5)
        loss_fn = DistillationLossFn(cfg.distillation.loss_settings())
        got = float(run.policy.train(data, loss_fn, eval_mode=True)["loss"][0])
        # the same rollout for a teacher of another tokenizer (cross-tokenizer distillation, issue 42)
        mapping = TeacherTokens(run.tokenizer, teacher_tokenizer())
        crossed = training_batch(rollout.data, torch.zeros_like(rollout.rewards))
        aligned = add_teacher_topk(run.teacher, crossed, 5, mapping)
        crossed_got = float(run.policy.train(crossed, loss_fn, eval_mode=True)["loss"][0])
    finally:
        run.shutdown()

    def logits(path, batch=data):
        model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float64)
        valid = torch.arange(batch["input_ids"].shape[1])[None] < batch["input_lengths"][:, None]
        with torch.no_grad():
            return model(input_ids=batch["input_ids"], attention_mask=valid.long()).logits[:, :-1]

    teacher_top = logits(resolved.teacher.config.model_name).topk(5, dim=-1)
    student = logits(cfg.policy.model_name).gather(-1, teacher_top.indices)
    pad = torch.zeros_like(student[:, :1])
    expected_data = {
        **data,
        LOGITS_AT_INDICES: torch.cat([pad, student], 1),
        TEACHER_LOGITS_KEY: torch.cat([pad, teacher_top.values], 1),
    }
    tokens = (data["token_mask"][:, 1:] * data["sample_mask"][:, None]).sum()
    w = cfg.distillation.mixed_kl_weight
    expected = _kl_float64(expected_data, "mixed", w) / tokens
    assert got == pytest.approx(float(expected), rel=1e-4)
    rows = torch.arange(teacher_top.indices.shape[1])[None] < (data["input_lengths"][:, None] - 1)
    assert torch.equal(data[LOGIT_INDICES_KEY][:, 1:][rows], teacher_top.indices[rows])  # the teacher Policy's top-k

    # Cross-tokenizer: the teacher Policy's top-k on its own tokens are the teacher's float64 ones at the aligned
    # rows (top-1 where it maps), and the student's loss over the mapped ids (slots with no counterpart at -inf)
    # equals the float64 recomputation.
    teacher_batch, rows = mapping.teacher_batch(data["input_ids"], data["input_lengths"], 10_000)
    teacher_top = logits(resolved.teacher.config.model_name, teacher_batch).topk(5, dim=-1)
    pad = torch.zeros_like(teacher_top.values[:, :1])
    values = torch.cat([pad, teacher_top.values], 1).gather(1, rows.clamp(min=0)[..., None].expand(-1, -1, 5))
    top1 = (crossed[TEACHER_LOGITS_KEY][..., 0] > float("-inf")) & (crossed["token_mask"] > 0)
    assert top1.sum() > 0 and 0 < aligned <= 1
    assert torch.allclose(
        crossed[TEACHER_LOGITS_KEY][..., 0][top1].double(), values[..., 0][top1], rtol=1e-4, atol=1e-4
    )
    student = logits(cfg.policy.model_name)
    student = torch.cat([torch.zeros_like(student[:, :1]), student], 1).gather(-1, crossed[LOGIT_INDICES_KEY])
    total, mask = 0.0, crossed["token_mask"] * crossed["sample_mask"][:, None]
    for b, i in (mask[:, 1:] > 0).nonzero().tolist():
        keep = crossed[TEACHER_LOGITS_KEY][b, i + 1] > float("-inf")
        p = torch.softmax(crossed[TEACHER_LOGITS_KEY][b, i + 1][keep].double(), -1)
        log_q = torch.log_softmax(student[b, i + 1][keep], -1)
        total += w * float((p * (p.log() - log_q)).sum()) + (1 - w) * float((log_q.exp() * (log_q - p.log())).sum())
    assert crossed_got == pytest.approx(total / float(mask[:, 1:].sum()), rel=1e-4)
