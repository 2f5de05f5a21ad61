"""The SFT loop behind ``rlcore run`` (a config with an ``sft`` section): one step, validation, the steps of a run.

Per step: take the next ``policy.train_global_batch_size`` samples, encode them
with the loss on the assistant's tokens (:mod:`rlcore.algorithms.sft.batches`), and
train one optimizer step with :class:`~rlcore.algorithms.loss_functions.NLLLoss`.
Validation (NeMo-RL's ``sft.val_*``) runs the same loss in eval mode over
``sft.val_batches`` batches of ``sft.val_global_batch_size`` samples; its
``validation/loss`` is the mean NLL per assistant token of all of them. The
pieces are started by :func:`rlcore.run.build.build_run` (no generation
backend, no environment).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rlcore.algorithms.toolkit import Timer, step_metrics, train_step
from rlcore.datasets import DataExhausted
from rlcore.interfaces.algorithm import Algorithm, OnStep, Resolution
from rlcore.run.errors import RunError

if TYPE_CHECKING:
    from rlcore.run.build import Run


class EmptyStep(RunError):
    """A step's batch trains nothing (every sample cut, every pair masked); the message says why and the fix."""


def sft_step(run: Run) -> dict[str, float]:
    """One optimizer step of NLL on the next batch of samples (:class:`EmptyStep` when none trains a token)."""
    from rlcore.algorithms.sft.batches import nothing_trained, sft_batch
    from rlcore.algorithms.sft.loss import NLLLoss

    timer = Timer()
    with timer.phase("data"):
        samples = run.draw_train_batch()
        batch = sft_batch(samples, run.tokenizer, run.cfg)
    if not float((batch["token_mask"][:, 1:] * batch["sample_mask"][:, None]).sum()):
        raise EmptyStep(nothing_trained(samples, run.tokenizer, run.cfg) or "no sample has a token to train")
    result = train_step(run, batch, NLLLoss(), timer)
    return step_metrics(
        run,
        result,
        timer,
        {
            "num_valid_tokens": float(result["metrics"].get("num_valid_tokens", 0.0)),
            "cut_samples": float((batch["sample_mask"] == 0).sum()),  # too long: sft.batches.LengthRule
        },
    )


def sft_validate(run: Run) -> dict[str, float]:
    """The NLL per assistant token of the validation samples, in eval mode (no gradient, no step)."""
    from rlcore.algorithms.sft.batches import sft_batch
    from rlcore.algorithms.sft.loss import NLLLoss

    cfg, started = run.cfg.sft, time.perf_counter()
    samples = run.data.validation or []
    size = cfg.val_global_batch_size
    total, tokens = 0.0, 0.0
    for begin in range(0, len(samples), size):
        batch = sft_batch(samples[begin : begin + size], run.tokenizer, run.cfg, size=size)
        result = run.policy.train(batch, NLLLoss(), eval_mode=True, gbs=size, mbs=cfg.val_micro_batch_size)
        valid = float((batch["token_mask"][:, 1:] * batch["sample_mask"][:, None]).sum())
        total += float(result["loss"][0]) * valid  # each batch's loss is its mean over its own valid tokens
        tokens += valid
    return {
        "validation/loss": total / tokens if tokens else float("nan"),
        "validation/num_samples": float(len(samples)),
        "validation/num_valid_tokens": tokens,
        "time/validation_s": time.perf_counter() - started,
    }


def sft_train(run: Run, on_step: Callable[[int, dict[str, float]], None]) -> str | None:
    """The steps of an SFT run (:func:`offline_train`)."""
    return offline_train(run, on_step, sft_step, sft_validate)


def offline_train(
    run: Run,
    on_step: Callable[[int, dict[str, float]], None],
    step_fn: Callable[[Run], dict[str, float]],
    validate_fn: Callable[[Run], dict[str, float]],
) -> str | None:
    """Run steps ``run.start_step .. run.num_steps - 1`` of an algorithm that trains on data as written (SFT,
    DPO), validating when due and calling ``on_step(step, metrics)`` after each; returns why the run ended
    early (the epochs' data ran out), or None. A step that would train nothing stops the run
    (:class:`EmptyStep`, naming the step) before its optimizer step."""
    from rlcore.run.validation import validation_due

    for step in range(run.start_step, run.num_steps):
        try:
            metrics = step_fn(run)
        except DataExhausted as exc:
            return f"the data ran out during step {step} ({exc})"
        except EmptyStep as exc:
            raise EmptyStep(f"step {step}: {exc}") from None
        if validation_due(run, step):
            metrics.update(validate_fn(run))
        on_step(step, metrics)
    return None


class OfflineAlgorithm(Algorithm):
    """An algorithm that trains on data as written (SFT, DPO): no rollouts, validation in eval-mode batches."""

    #: Whether its batches carry a sample's images to a vision-language model (docs/vision.md); if not, a
    #: sample with images is refused when the data is loaded.
    takes_images = False

    def resolve(self, cfg: Any, policy: Any, generation: Any, registry: Any, notices: list[str]) -> Resolution:
        """Validation batches must split over the ranks as training's do."""
        from rlcore.config.batch_plan import batch_problems

        s, plan, name = self.section(cfg), policy.batch, self.name
        problems = batch_problems(
            s.val_global_batch_size,
            s.val_micro_batch_size,
            plan.data_parallel_size,
            plan.mode,
            gbs_name=f"{name}.val_global_batch_size",
            mbs_name=f"{name}.val_micro_batch_size",
        )
        return Resolution(cfg, problems)

    def load_data(self, cfg: Any, tokenizer: Any) -> Any:
        """The samples, every fixed one checked for what the loss trains on (:meth:`sample_problem`), and the
        fixed training samples for one that trains anything (:meth:`nothing_trained`); a generator's samples are
        checked as they are made, and a step that trains nothing stops the run (:class:`EmptyStep`)."""
        from rlcore.datasets import DataError, load_sources
        from rlcore.run.image_prompts import image_model_of

        images = self.takes_images and image_model_of(cfg) is not None
        data = checked_samples(load_sources(cfg, images=images), self.sample_problem)
        fixed = getattr(data.train, "samples", None)
        if fixed and (why := self.nothing_trained(fixed, tokenizer, cfg)):
            raise DataError(f"data.train: {why}")
        return data

    def sample_problem(self, sample: Any, where: str) -> str | None:
        return None

    def nothing_trained(self, samples: list[Any], tokenizer: Any, cfg: Any) -> str | None:
        """Why none of ``samples`` would train anything, or None (as soon as one would)."""
        return None


class SFT(OfflineAlgorithm):
    """Supervised fine-tuning: NLL on the assistant tokens of chat samples."""

    headline = ("loss", "validation/loss")
    curve = ("loss", "loss", "loss_curve.png")
    takes_images = True

    def sample_problem(self, sample: Any, where: str) -> str | None:
        from rlcore.algorithms.sft.batches import answer_problem

        return answer_problem(sample, where)

    def nothing_trained(self, samples: list[Any], tokenizer: Any, cfg: Any) -> str | None:
        from rlcore.algorithms.sft.batches import nothing_trained

        return nothing_trained(samples, tokenizer, cfg)

    def train(self, run: Run, on_step: OnStep) -> str | None:
        return sft_train(run, on_step)

    def validate(self, run: Run) -> dict[str, float]:
        return sft_validate(run)


def checked_samples(data: Any, problem: Callable[[Any, str], str | None]) -> Any:
    """``data`` after ``problem(sample, where)`` found nothing wrong with any fixed sample (train and validation);
    raises :class:`rlcore.datasets.DataError` with the first problem. A generator's samples are checked as they
    are made."""
    from rlcore.datasets import DataError

    for where, samples in (("data.train", getattr(data.train, "samples", [])), ("data.validation", data.validation)):
        for sample in samples or []:
            if found := problem(sample, where):
                raise DataError(found)
    return data
