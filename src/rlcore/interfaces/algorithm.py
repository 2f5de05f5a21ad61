"""The algorithm unit: what ``rlcore run`` asks of a training algorithm (GRPO, SFT, DPO, distillation, a third
party's).

An algorithm is declared by an :class:`~rlcore.plugins.AlgorithmSpec` (its name is its config section's key; the
spec's ``default``, ``generates`` and ``unread_sections`` are what a config check needs without importing the
algorithm) and implemented by a subclass of :class:`Algorithm`, named in the spec's ``algorithm_class``. The run
reaches it only through the registry, so the core compares no algorithm's name. Every method has a default
except the loop itself; a module defining an algorithm imports torch and the like inside its methods.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from rlcore.interfaces.run import RunContext

#: ``on_step(step, metrics)``: the run logs, checkpoints and counts a finished step.
OnStep = Callable[[int, dict[str, float]], None]


@dataclass
class Resolution:
    """What an algorithm decides when a run's config is resolved (:func:`rlcore.config.resolve`)."""

    config: Any  # the whole config, with the algorithm's automatic settings written in
    problems: list[str] = field(default_factory=list)  # one line each, with its dotted path
    async_generation: bool = False  # rollouts are generated ahead of training
    teacher: Any = None  # a ResolvedPolicy of a frozen second model (distillation's teacher)
    # A ResolvedPolicy of a trained second model with a value head (PPO's critic): built with model_head="value",
    # its own optimizer, checkpointed beside the policy (``value/`` of a step) and restored by --resume.
    value_model: Any = None
    # The policy's head: "lm" (a causal LM, every algorithm that generates or trains on logprobs) or "value" (a
    # scalar head, built with Policy(model_head="value") on a backend declaring value_head: a reward model's training).
    policy_head: str = "lm"


class Algorithm:
    """One training algorithm as ``rlcore run`` drives it.

    ``name`` is the registered name (its config section's key). A run calls, in order: :meth:`resolve` (once,
    with the resolved policy), :meth:`load_data`, :meth:`needs_reference_model` (when the policy starts), then
    :meth:`train` with :meth:`validate` around it; :attr:`headline` and :attr:`curve` say what the summary and
    the plot show.
    """

    #: ``(training metric, validation metric)`` the run's summary reports, first and last value.
    headline: ClassVar[tuple[str, str]] = ("loss", "validation/loss")
    #: ``(metric, axis label, file name)`` of the curve plotted after the run.
    curve: ClassVar[tuple[str, str, str]] = ("loss", "loss", "loss_curve.png")

    def __init__(self, name: str, generates: bool = False) -> None:
        self.name = name
        self.generates = generates  # the spec's flag: rollouts, a generation backend and an environment

    def section(self, cfg: Any) -> Any:
        """This algorithm's section of ``cfg``."""
        return getattr(cfg, self.name)

    # -- resolve time --------------------------------------------------------------------------------
    def resolve(self, cfg: Any, policy: Any, generation: Any, registry: Any, notices: list[str]) -> Resolution:
        """Problems of ``cfg`` given the resolved policy and generation backend, and what the algorithm decides
        (appending a notice for a default it chose). Default: nothing."""
        return Resolution(cfg)

    # -- the run -------------------------------------------------------------------------------------
    def load_data(self, cfg: Any, tokenizer: Any) -> Any:
        """The run's samples (:class:`rlcore.datasets.sources.RunData`), checked before anything starts; raises
        :class:`rlcore.datasets.DataError` (one line)."""
        raise NotImplementedError(f"algorithm '{self.name}' reads no data")

    def needs_reference_model(self, cfg: Any) -> bool:
        """Whether each rank keeps a frozen copy of the initial weights (a KL term, DPO's reference). Default:
        no; an algorithm whose loss needs one says so (GRPO with a KL penalty, DPO)."""
        return False

    def one_batch_per_step(self, cfg: Any) -> bool:
        """Whether each step draws exactly one batch (a resumed run then checks the data position)."""
        return True

    def train(self, run: RunContext, on_step: OnStep) -> str | None:
        """Train steps ``run.start_step .. run.num_steps - 1``, calling ``on_step`` after each; returns why the
        data ended early, or None. ``run`` (:class:`~rlcore.interfaces.run.RunContext`): the policy, the engines,
        the environment and the data; a rollout algorithm keeps the step order of
        :mod:`rlcore.algorithms.toolkit` (docs/writing-an-algorithm.md)."""
        raise NotImplementedError(f"algorithm '{self.name}' has no loop")

    def validate(self, run: RunContext) -> dict[str, float]:
        """Validation metrics (``validation/...``) of the current weights."""
        return {}

    def describe(self, resolved: Any, workers: str, source: str, steps: int) -> str:
        """What ``rlcore run`` says it is about to train, in one line (after ``rlcore run: ``)."""
        cfg = resolved.config
        p = cfg.policy
        if resolved.generation is None:
            return f"{self.name.upper()} with {p.training_backend} {workers}, {source}, {steps} steps"
        gen = resolved.generation
        placement = "" if not gen.separate else (" colocated" if gen.colocated else " separate")
        up_to = "" if self.one_batch_per_step(cfg) else "up to "
        return (
            f"{self.what(cfg)}{p.training_backend} + {p.generation.backend}{placement} {workers}, {source} "
            f"scored by {cfg.env.name}, {up_to}{steps} steps"
        )

    def what(self, cfg: Any) -> str:
        """The start of a generating run's description (``''`` or e.g. ``'distillation from X, '``)."""
        return ""


__all__ = ["Algorithm", "OnStep", "Resolution"]
