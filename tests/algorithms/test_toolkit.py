"""The algorithm author's toolkit (:mod:`rlcore.algorithms.toolkit`): a rollout step's order (refit when stale,
prepare and finish generation around sampling and scoring, prepare and finish training, mark the weights stale),
and a step on fewer rows than a global batch (the same update as the masked whole batch, against a float64
reference). No Ray: the run's pieces are recording stand-ins and an in-process policy on rlcore's training loop."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from rlcore.algorithms.toolkit import (
    Timer,
    generating,
    pad_rows,
    sample_and_score,
    step_metrics,
    step_rows,
    train_step,
    training_batch,
)
from rlcore.data import BatchedDataDict
from rlcore.training.loop import StepHooks, train_steps
from tests.run.test_multi_turn import ByteTokenizer, CountingEnvironment, ScriptedEngine, _samples


class Recorder:
    """Each piece appends what was called to one shared list."""

    def __init__(self, calls: list[str], name: str) -> None:
        self.calls, self.name = calls, name

    def note(self, what: str) -> None:
        self.calls.append(f"{self.name}.{what}")


class Engines(Recorder):
    def __init__(self, calls: list[str]) -> None:
        super().__init__(calls, "generation")
        self.engine = ScriptedEngine()

    def prepare_for_generation(self) -> bool:
        self.note("prepare_for_generation")
        return True

    def finish_generation(self) -> bool:
        self.note("finish_generation")
        return True

    def generate(self, batch: Any, greedy: bool = False) -> Any:
        self.note(f"generate(greedy={greedy})")
        return self.engine(batch)


class Synchronizer(Recorder):
    def __init__(self, calls: list[str], stale: bool) -> None:
        super().__init__(calls, "synchronizer")
        self.stale = stale

    def sync_weights(self) -> dict[str, float]:
        self.note("sync_weights")
        self.stale = False
        return {"bytes": 1234.0}


class RecordingPolicy(Recorder):
    def __init__(self, calls: list[str]) -> None:
        super().__init__(calls, "policy")
        self.trained: list[tuple[BatchedDataDict, dict]] = []

    def __getattr__(self, name: str) -> Any:  # prepare/finish/offload: recorded
        if name.startswith(("prepare_", "finish_", "offload_")):
            return lambda *a, **k: self.note(name)
        raise AttributeError(name)

    def train(self, data: BatchedDataDict, loss_fn: Any, **kwargs: Any) -> dict[str, Any]:
        self.note("train")
        self.trained.append((data, kwargs))
        return {"loss": torch.tensor([0.5]), "grad_norm": torch.tensor([2.0]), "metrics": {}}


class Environment(CountingEnvironment):
    def __init__(self, calls: list[str]) -> None:
        super().__init__()
        self.calls = calls

    def step(self, logs: Any, metadata: Any) -> Any:
        self.calls.append("environment.step")
        return super().step(logs, metadata)


def recording_run(stale: bool, gbs: int = 4, dp: int = 1, mbs: int = 1, mode: str = "plain") -> SimpleNamespace:
    calls: list[str] = []
    batches = iter([_samples(1, 1)])
    return SimpleNamespace(
        calls=calls,
        cfg=SimpleNamespace(
            algorithm_section=SimpleNamespace(max_rollout_turns=1),
            policy=SimpleNamespace(
                max_total_sequence_length=64,
                tokenizer=SimpleNamespace(chat_template_kwargs={}),
                train_global_batch_size=gbs,
            ),
        ),
        batch=SimpleNamespace(global_batch_size=gbs, data_parallel_size=dp, micro_batch_size=mbs, mode=mode),
        policy=RecordingPolicy(calls),
        generation=Engines(calls),
        synchronizer=Synchronizer(calls, stale),
        environment=Environment(calls),
        tokenizer=ByteTokenizer(),
        data=SimpleNamespace(train=SimpleNamespace(epoch_of=lambda k: 0)),
        next_batch=0,
        draw_train_batch=lambda: next(batches),
    )


def one_step(run: SimpleNamespace) -> tuple[float, Any, dict[str, float]]:
    timer = Timer()
    with generating(run, timer) as moved:
        rollout = sample_and_score(run, timer, repeat=2)
    result = train_step(run, training_batch(rollout.data, rollout.rewards), object(), timer)
    return moved, rollout, step_metrics(run, result, timer, {"extra": 1.0})


def test_a_step_keeps_the_order_refit_generate_score_train_mark_stale():
    run = recording_run(stale=True)
    moved, rollout, metrics = one_step(run)
    assert run.calls == [
        "policy.offload_before_refit",
        "synchronizer.sync_weights",
        "policy.offload_after_refit",
        "generation.prepare_for_generation",
        "generation.generate(greedy=False)",
        "environment.step",
        "generation.finish_generation",
        "policy.prepare_for_training",
        "policy.train",
        "policy.finish_training",
    ]
    assert moved == 1234.0 and run.synchronizer.stale  # refit, then stale again once the policy trained
    assert rollout.rewards.tolist() == [1.0, 1.0, 1.0, 1.0]  # 2 samples × 2 completions, scored once each
    assert run.policy.trained[0][1] == {}  # a whole global batch (4 rows): trained as before, no gbs given
    assert metrics["loss"] == 0.5 and metrics["grad_norm"] == 2.0 and metrics["extra"] == 1.0
    assert {"time/refit_s", "time/generation_s", "time/environment_s", "time/train_s"} <= set(metrics)


def test_fresh_weights_are_not_refit():
    run = recording_run(stale=False)
    moved, _, _ = one_step(run)
    assert moved == 0.0 and "synchronizer.sync_weights" not in run.calls
    assert run.calls[0] == "generation.prepare_for_generation" and run.synchronizer.stale


@pytest.mark.parametrize(
    ("rows", "gbs", "dp", "mbs", "mode", "trained"),
    [
        (8, 8, 2, 2, "plain", 8),  # a whole global batch
        (24, 8, 2, 2, "plain", 24),  # three
        (5, 16, 2, 2, "plain", 8),  # fewer: up to dp × mbs
        (4, 16, 2, 2, "plain", 4),  # fewer, already whole micro-batches on every rank
        (5, 16, 2, 4, "dynamic", 6),  # token budgets: up to dp
        (7, 8, 2, 4, "plain", 8),  # never past a global batch
    ],
)
def test_the_rows_a_step_trains(rows, gbs, dp, mbs, mode, trained):
    run = recording_run(stale=False, gbs=gbs, dp=dp, mbs=mbs, mode=mode)
    assert step_rows(rows, run) == trained


def test_a_row_count_it_cannot_train_is_refused_in_one_line():
    run = recording_run(stale=False, gbs=8, dp=2, mbs=2)
    with pytest.raises(ValueError, match=r"^train_step: 12 rows are neither whole global batches of 8 .* train 8 of"):
        step_rows(12, run)
    with pytest.raises(ValueError, match=r"^train_step: no rows to train"):
        step_rows(0, run)


def test_padding_rows_are_masked_copies():
    data = BatchedDataDict(
        input_ids=torch.arange(6).reshape(3, 2), sample_mask=torch.tensor([1.0, 0.0, 1.0]), names=["a", "b", "c"]
    )
    padded = pad_rows(data, 5)
    assert padded["input_ids"].tolist() == [[0, 1], [2, 3], [4, 5], [0, 1], [0, 1]]
    assert padded["sample_mask"].tolist() == [1.0, 0.0, 1.0, 0.0, 0.0] and padded["names"] == ["a", "b", "c", "a", "a"]
    assert pad_rows(data, 3) is data


class NLL:
    """Token-mean NLL over the step's valid tokens (``token_mask * sample_mask`` at positions 1..)."""

    loss_type = "token_level"

    def __call__(self, logprobs: torch.Tensor, data: Any, global_seqs: Any, global_toks: Any) -> tuple[Any, dict]:
        mask = data["token_mask"][:, 1:].double() * data["sample_mask"][:, None].double()
        loss = -(logprobs[:, 1:] * mask).sum() / global_toks
        return loss, {"num_valid_tokens": float(mask.sum())}


class InProcessPolicy:
    """One rank in this process on rlcore's training loop: a float64 table of next-token logits, plain SGD
    (``lr``); ``train`` cuts global batches as :class:`rlcore.policy.Policy` does (``gbs`` rows a step)."""

    def __init__(self, weight: torch.Tensor, gbs: int, mbs: int, lr: float = 0.5) -> None:
        self.weight = torch.nn.Parameter(weight.clone())
        self.gbs, self.mbs, self.lr = gbs, mbs, lr
        self.calls: list[int] = []

    def prepare_for_training(self) -> None: ...

    def finish_training(self) -> None: ...

    def train(self, data: BatchedDataDict, loss_fn: Any, *, gbs: int | None = None) -> dict[str, Any]:
        gbs = gbs or self.gbs
        assert data.size % gbs == 0
        self.calls.append(data.size)
        w = self.weight

        def forward(mb: BatchedDataDict) -> torch.Tensor:
            ids = mb["input_ids"]
            logp = torch.log_softmax(w[ids[:, :-1]], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            return torch.cat([torch.zeros_like(logp[:, :1]), logp], dim=1)

        def step() -> None:
            with torch.no_grad():
                w.sub_(self.lr * w.grad)
            w.grad = None

        def zero() -> None:
            w.grad = None

        hooks = StepHooks(
            forward=forward,
            all_reduce_sum=lambda t: None,
            finish_grads=lambda: None,
            clip_grads=lambda max_norm: float(w.grad.norm()),
            optimizer_step=step,
            zero_grad=zero,
        )
        out = train_steps(data, loss_fn, hooks, local_batch_size=gbs, mbs=self.mbs, max_grad_norm=None)
        zero()
        return {"loss": torch.tensor(out["losses"]), "grad_norm": torch.tensor(out["grad_norms"]), "metrics": {}}


def nll_batch(rows: int, vocab: int = 7, width: int = 6, seed: int = 0) -> BatchedDataDict:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, width + 1, (rows,), generator=gen)
    positions = torch.arange(width)[None, :]
    return BatchedDataDict(
        input_ids=torch.randint(0, vocab, (rows, width), generator=gen),
        input_lengths=lengths,
        token_mask=((positions >= 2) & (positions < lengths[:, None])).long(),  # 2 prompt tokens, then generated
        sample_mask=torch.ones(rows),
    )


def float64_reference(weight: torch.Tensor, data: BatchedDataDict, lr: float) -> tuple[float, torch.Tensor]:
    """One SGD step on the token-mean NLL of ``data``'s valid tokens, written out directly."""
    w = weight.clone().requires_grad_(True)
    total, count = 0.0, 0
    terms = []
    for b in range(data.size):
        if not data["sample_mask"][b]:
            continue
        for t in range(1, data["input_ids"].shape[1]):
            if data["token_mask"][b, t]:
                prev, tok = int(data["input_ids"][b, t - 1]), int(data["input_ids"][b, t])
                terms.append(-torch.log_softmax(w[prev], dim=-1)[tok])
                count += 1
    loss = torch.stack(terms).sum() / count
    loss.backward()
    total = float(loss)
    return total, (weight - lr * w.grad).detach()


def test_a_step_on_fewer_rows_is_the_masked_whole_batch_s_update():
    gbs, mbs, lr = 16, 4, 0.5
    weight = torch.randn(7, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    whole = nll_batch(gbs)
    kept = [0, 3, 4, 9, 10]  # 5 rows: padded to 8 (2 micro-batches of 4), one optimizer step
    run = recording_run(stale=True, gbs=gbs, dp=1, mbs=mbs)

    run.policy = InProcessPolicy(weight, gbs, mbs, lr)
    result = train_step(run, whole.select_indices(kept), NLL())
    assert run.policy.calls == [8] and run.synchronizer.stale
    few_loss, few_weight = float(result["loss"][0]), run.policy.weight.detach().clone()

    masked = whole.copy()
    masked["sample_mask"] = torch.tensor([float(i in kept) for i in range(gbs)])
    run.policy = InProcessPolicy(weight, gbs, mbs, lr)
    masked_loss = float(train_step(run, masked, NLL())["loss"][0])
    assert run.policy.calls == [16]

    # the training loop hands the loss float32 logprobs: equal to float32 precision
    ref_loss, ref_weight = float64_reference(weight, whole.select_indices(kept), lr)
    assert few_loss == pytest.approx(ref_loss, rel=1e-6) and masked_loss == pytest.approx(ref_loss, rel=1e-6)
    assert torch.allclose(few_weight, ref_weight, atol=1e-6, rtol=0)
    assert torch.allclose(run.policy.weight.detach(), ref_weight, atol=1e-6, rtol=0)
    assert few_loss == pytest.approx(masked_loss, rel=1e-6)
    assert not torch.allclose(few_weight, weight)  # it did train


def test_ahead_generates_through_the_asynchronous_calls():
    """A loop that generates ahead of training (asynchronous GRPO's rollout thread) submits and collects."""
    run = recording_run(stale=False)
    engines = run.generation

    def generate_async(batch: Any, greedy: bool = False) -> tuple[str, Any]:
        engines.note(f"generate_async(greedy={greedy})")
        return ("handle", batch)

    def collect(handle: tuple[str, Any]) -> Any:
        engines.note("collect")
        return engines.engine(handle[1])

    engines.generate_async, engines.collect = generate_async, collect
    rollout = sample_and_score(run, Timer(), repeat=2, ahead=True)
    assert run.calls == ["generation.generate_async(greedy=False)", "generation.collect", "environment.step"]
    assert rollout.rewards.tolist() == [1.0, 1.0, 1.0, 1.0]
