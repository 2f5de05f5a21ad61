"""The conformance kit's resume check: a checkpoint must *resume* training, not only reload (design.md §2.8).

A backend whose checkpoint drops the optimizer or the learning-rate scheduler
state reloads its weights perfectly and then trains differently. So the check
trains with Adam and a linear warm-up (both stateful): one policy runs
:data:`RESUME_STEPS` steps uninterrupted, saving weights + optimizer after
step :data:`CHECKPOINT_STEP`; a new policy started from that checkpoint runs
the remaining steps. Losses, gradient norms and weights must equal the
uninterrupted run's (float32 round-off). The uninterrupted run is itself
compared with a single-process Adam oracle, so a backend that silently trains
with a stateless optimizer cannot pass vacuously.

When a resumed step differs, the first differing update is diagnosed against
the oracle: the same direction at another scale means the learning-rate
schedule was not restored; the direction of a freshly built Adam means the
optimizer state (Adam moments) was not.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlcore.testing.conformance.checkers import logprob_problems
from rlcore.testing.oracle import (
    StepRecord,
    close,
    hf_token_logprobs,
    load_hf_model,
    oracle_gradients,
    state_copy,
    step_problems,
    train_and_save_step,
)

if TYPE_CHECKING:
    import torch

    from rlcore.interfaces.specs import TrainingBatch

#: Optimizer steps of the check; the checkpoint is taken after step CHECKPOINT_STEP.
RESUME_STEPS = 3
CHECKPOINT_STEP = 1
#: Cosine above which two updates count as pointing the same way (a pure lr change gives 1 - O(1e-12)).
SAME_DIRECTION = 0.9999
#: Cosine above which the resumed update is taken to be a fresh optimizer's (oracle vs backend gradients).
FRESH_DIRECTION = 0.999
DIFFERS = "after resume the update differs from uninterrupted training: "


@dataclass(frozen=True)
class AdamRecipe:
    """The check's optimizer: Adam without weight decay and a linear LR warm-up.

    Both carry state across steps (moments and step count; the schedule's
    position), so losing either changes the next updates. ``eps`` is large
    enough that gradient elements at round-off level are not blown up to a
    full ``lr`` step (Adam's ``g / |g|``), which would make float32 noise
    between layouts look like a bug.
    """

    lr: float = 1e-2
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-4
    warmup_start_factor: float = 0.25
    warmup_steps: int = 4

    def lr_at(self, step: int) -> float:
        """Learning rate of optimizer step ``step`` (1-based): ``LinearLR`` and megatron's linear warm-up."""
        done = min(step - 1, self.warmup_steps)
        start = self.warmup_start_factor
        return self.lr * (start + (1.0 - start) * done / self.warmup_steps)

    def policy_overrides(self) -> dict:
        """The recipe in rlcore's generic ``policy.optimizer`` / ``policy.scheduler`` config."""
        return {
            "learning_rate": self.lr,
            "optimizer": {
                "name": "torch.optim.AdamW",
                "kwargs": {"lr": self.lr, "betas": list(self.betas), "eps": self.eps, "weight_decay": 0.0},
            },
            "scheduler": [
                {
                    "name": "torch.optim.lr_scheduler.LinearLR",
                    "kwargs": {
                        "start_factor": self.warmup_start_factor,
                        "end_factor": 1.0,
                        "total_iters": self.warmup_steps,
                    },
                }
            ],
        }


RECIPE = AdamRecipe()


@dataclass(frozen=True)
class ResumeTolerances:
    """``exact_*``: resumed vs uninterrupted (same backend, same layout); ``oracle_rtol``: vs the oracle."""

    logprob_atol: float
    exact_atol: float
    exact_rtol: float
    oracle_rtol: float


# --------------------------------------------------------------------------- single-process Adam oracle


class _Adam:
    """Adam written out (no weight decay), so the oracle shares no optimizer or state code with backends."""

    def __init__(self, recipe: AdamRecipe) -> None:
        self.recipe = recipe
        self.moments: dict[str, tuple[Any, Any]] = {}
        self.steps = 0

    def update(self, grads: dict[str, torch.Tensor], lr: float) -> dict[str, torch.Tensor]:
        """The step to add to each parameter, advancing the moments."""
        beta1, beta2 = self.recipe.betas
        self.steps += 1
        correction1, correction2 = 1 - beta1**self.steps, 1 - beta2**self.steps
        out = {}
        for name, grad in grads.items():
            m, v = self.moments.get(name, (0.0, 0.0))
            m, v = beta1 * m + (1 - beta1) * grad, beta2 * v + (1 - beta2) * grad * grad
            self.moments[name] = (m, v)
            out[name] = -(lr / correction1) * m / ((v / correction2).sqrt() + self.recipe.eps)
        return out


def _apply(model: Any, update: dict[str, torch.Tensor]) -> None:
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in update:
                param += update[name]


def single_process_adam(
    model_dir: str, steps: list[tuple[Any, Any]], recipe: AdamRecipe
) -> tuple[dict, list[StepRecord]]:
    """:func:`~rlcore.testing.oracle.single_process_sgd` with the recipe's Adam and warm-up."""
    model = load_hf_model(model_dir)
    model.train()
    initial, records, adam = state_copy(model), [], _Adam(recipe)
    for k, (data, loss_fn) in enumerate(steps, start=1):
        loss, grads = oracle_gradients(model, data, loss_fn)
        _apply(model, adam.update(grads, recipe.lr_at(k)))
        records.append(StepRecord(loss, _norm(grads.values()), state_copy(model)))
    return initial, records


def fresh_adam_update(
    model_dir: str, weights: dict, data: Any, loss_fn: Any, recipe: AdamRecipe
) -> dict[str, torch.Tensor]:
    """The update at lr 1 of an Adam built just now at ``weights``: what a resume that lost the moments does."""
    model = load_hf_model(model_dir)
    model.load_state_dict(weights)
    model.train()
    _, grads = oracle_gradients(model, data, loss_fn)
    return _Adam(recipe).update(grads, lr=1.0)


def _norm(tensors: Any) -> float:
    return math.sqrt(sum(float(t.double().square().sum()) for t in tensors))


# --------------------------------------------------------------------------- running the backend


def resume_steps(first: Any, tokenizer: Any, batch_size: int) -> list[tuple[Any, Any]]:
    """The check's :data:`RESUME_STEPS` optimizer steps: NLL on ``first``, then on fresh seeded batches."""
    from rlcore.algorithms.sft.loss import NLLLoss
    from rlcore.data import BatchedDataDict
    from rlcore.testing.models import make_batch

    fresh: list[BatchedDataDict[TrainingBatch]] = [
        BatchedDataDict(make_batch(tokenizer, batch_size, 5, 16, seed=seed)) for seed in range(2, RESUME_STEPS + 1)
    ]
    return [(data, NLLLoss()) for data in [first, *fresh]]


@dataclass
class ResumeRun:
    """What the two policies of the check produced."""

    uninterrupted: list[StepRecord]
    resumed: list[StepRecord]  # steps CHECKPOINT_STEP + 1 ... RESUME_STEPS
    checkpoint_dir: str
    saved_logprobs: Any  # the uninterrupted policy's logprobs when it saved the checkpoint
    restored_logprobs: Any  # the resumed policy's, before it trained


def run_resume(
    start: Callable[..., Any], stop: Callable[[str], None], steps: list[tuple[Any, Any]], probe: Any, tmp_dir: Path
) -> ResumeRun:
    """Train uninterrupted (checkpointing once), then resume a new policy from the checkpoint.

    ``start(name, **policy_kwargs)`` starts a policy with the recipe's config;
    ``stop(name)`` shuts it down. ``probe`` is the batch whose logprobs show
    that the restored weights are the saved ones.
    """
    checkpoint, optimizer = tmp_dir / "adam-checkpoint", tmp_dir / "adam-checkpoint-optim"
    policy = start("adam")
    try:
        uninterrupted = []
        for k, (data, loss_fn) in enumerate(steps, start=1):
            at_checkpoint = k == CHECKPOINT_STEP
            weights = checkpoint if at_checkpoint else tmp_dir / f"adam-step{k}"
            uninterrupted.append(
                train_and_save_step(policy, data, loss_fn, weights, optimizer if at_checkpoint else None)
            )
            if at_checkpoint:
                saved = policy.get_logprobs(probe)["logprobs"]
    finally:
        stop("adam")
    policy = start("resumed", weights_path=str(checkpoint), optimizer_path=str(optimizer))
    try:
        restored = policy.get_logprobs(probe)["logprobs"]
        resumed = [
            train_and_save_step(policy, data, loss_fn, tmp_dir / f"resumed-step{k}", None)
            for k, (data, loss_fn) in enumerate(steps[CHECKPOINT_STEP:], start=CHECKPOINT_STEP + 1)
        ]
    finally:
        stop("resumed")
    return ResumeRun(uninterrupted, resumed, str(checkpoint), saved, restored)


# --------------------------------------------------------------------------- checks


def resume_problems(
    run: ResumeRun, steps: list[tuple[Any, Any]], probe: Any, model_dir: str, recipe: AdamRecipe, tol: ResumeTolerances
) -> list[str]:
    """Everything wrong with ``run``; empty when the checkpoint resumes training exactly."""
    import torch

    with torch.no_grad():
        hf = hf_token_logprobs(load_hf_model(run.checkpoint_dir), probe)
    lengths = probe["input_lengths"]
    problems = logprob_problems(
        run.saved_logprobs,
        lengths,
        hf,
        tol.logprob_atol,
        what="logprobs at the checkpoint vs HF forward of the saved weights",
    )
    problems += logprob_problems(
        run.restored_logprobs,
        lengths,
        run.saved_logprobs,
        tol.logprob_atol,
        what="logprobs of the policy restored from the checkpoint",
    )
    problems += _oracle_problems(run.uninterrupted, single_process_adam(model_dir, steps, recipe), tol)
    problems += _resumed_problems(run, steps, model_dir, recipe, tol)
    return problems


def _oracle_problems(
    actual: list[StepRecord], oracle: tuple[dict, list[StepRecord]], tol: ResumeTolerances
) -> list[str]:
    """The uninterrupted run is the recipe's Adam + warm-up (else the resume comparison proves little)."""
    before, expected = oracle
    problems = step_problems(
        actual,
        expected,
        before,
        "uninterrupted Adam run vs single-process Adam oracle",
        loss_rtol=tol.oracle_rtol,
        grad_norm_rtol=tol.oracle_rtol,
        weight_rtol=tol.oracle_rtol,
    )
    if not problems:
        return []
    return [
        "the uninterrupted run is not the kit's Adam with LR warm-up (AdamRecipe), so the resume comparison "
        "would prove little; a backend with its own optimizer settings maps the recipe in "
        "resume_policy_overrides(recipe)",
        *problems,
    ]


def _resumed_problems(
    run: ResumeRun, steps: list[tuple[Any, Any]], model_dir: str, recipe: AdamRecipe, tol: ResumeTolerances
) -> list[str]:
    """Resumed steps vs uninterrupted ones; the first difference is diagnosed and ends the comparison."""
    for k, got in enumerate(run.resumed, start=CHECKPOINT_STEP + 1):
        want, before = run.uninterrupted[k - 1], run.uninterrupted[k - 2].weights
        where = f"resumed step {k}"
        if not close(got.loss, want.loss, tol.exact_rtol):
            return [
                f"{where}: loss {got.loss!r} != uninterrupted {want.loss!r}: the model the checkpoint "
                "restored is not the one that was saved"
            ]
        if not close(got.grad_norm, want.grad_norm, tol.exact_rtol):
            return [f"{where}: grad_norm {got.grad_norm!r} != uninterrupted {want.grad_norm!r} at the same loss"]
        worst = max(float((got.weights[n].double() - w.double()).abs().max()) for n, w in want.weights.items())
        if not worst <= tol.exact_atol:
            data, loss_fn = steps[k - 1]
            fresh = fresh_adam_update(model_dir, before, data, loss_fn, recipe)
            return [
                f"{where}: weights differ from uninterrupted training by up to {worst:.3g} (> {tol.exact_atol:g})",
                diagnose_update(k, before, got.weights, want.weights, fresh, recipe),
            ]
    return []


def diagnose_update(step: int, before: dict, actual: dict, expected: dict, fresh: dict, recipe: AdamRecipe) -> str:
    """Name what the resume lost, from the direction and size of its first differing update.

    ``fresh`` is the oracle's lr-1 update of a new Adam from ``before``. The
    same direction as ``expected`` at another scale: the learning rate was
    wrong (schedule). The direction of ``fresh``: the Adam moments were lost.
    """
    names = sorted(fresh)
    got, want = _delta(actual, before, names), _delta(expected, before, names)
    new = _flat([fresh[n] for n in names])
    cos_want, cos_fresh = _cosine(got, want), _cosine(got, new)
    scheduled = recipe.lr_at(step)
    ratio = float(got @ want / (want @ want)) if float(want @ want) > 0 else math.inf
    if cos_want >= SAME_DIRECTION and abs(ratio - 1) <= 1 - SAME_DIRECTION:
        return (
            f"{DIFFERS}resumed step {step}'s update has uninterrupted training's direction and size (ratio "
            f"{ratio:.6f}) but is not equal to it: is the backend's training step nondeterministic?"
        )
    if cos_want >= SAME_DIRECTION:
        return (
            f"{DIFFERS}learning-rate schedule was not restored: resumed step {step} moved the weights in "
            f"uninterrupted training's direction but {ratio:.4g}x as far (lr ~ {ratio * scheduled:.4g}, the "
            f"schedule gives {scheduled:.4g} at step {step})"
        )
    if cos_fresh >= FRESH_DIRECTION:
        lr = float(got @ new / (new @ new))
        restarted = (
            "; the learning-rate schedule restarted too"
            if math.isclose(lr, recipe.lr_at(1), rel_tol=1e-3) and lr != scheduled
            else ""
        )
        return (
            f"{DIFFERS}optimizer state (Adam moments) was not restored: resumed step {step}'s update points "
            f"like a freshly built optimizer's (cosine {cos_fresh:.5f}), not like uninterrupted training's "
            f"(cosine {cos_want:.5f}); it ran at lr ~ {lr:.4g} where the schedule gives {scheduled:.4g}"
            f"{restarted}"
        )
    return (
        f"{DIFFERS}resumed step {step}'s update has cosine {cos_want:.5f} with uninterrupted training's "
        f"and {cos_fresh:.5f} with a fresh optimizer's; neither lost Adam moments nor a wrong learning rate "
        "explains it"
    )


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    import torch

    return torch.cat([t.detach().double().reshape(-1) for t in tensors])


def _delta(after: dict, before: dict, names: list[str]) -> torch.Tensor:
    return _flat([after[n] for n in names]) - _flat([before[n] for n in names])


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    denom = float(a.norm() * b.norm())
    return float(a @ b) / denom if denom > 0 else 0.0


__all__ = [
    "CHECKPOINT_STEP",
    "RECIPE",
    "RESUME_STEPS",
    "AdamRecipe",
    "ResumeRun",
    "ResumeTolerances",
    "diagnose_update",
    "fresh_adam_update",
    "resume_problems",
    "resume_steps",
    "run_resume",
    "single_process_adam",
]
