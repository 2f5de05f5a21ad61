"""``RunContext``: what an algorithm may use of the run it trains (:meth:`rlcore.interfaces.algorithm.Algorithm.train`).

``rlcore run`` builds a :class:`rlcore.run.build.Run` (cluster, policy, generation backend, synchronizer,
environment, data) and hands it to the algorithm's ``train`` and ``validate``. This protocol names the part of it
an algorithm reads, so an algorithm is written against a contract rather than the run's implementation. The
types are this layer's contracts (the policy and generation interfaces, the environment protocol) or small
protocols of what is read; the config is rlcore's whole ``RLCoreConfig`` (``rlcore.config`` sits beside this
package and imports it, so it is not named here).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from rlcore.interfaces.environment import EnvironmentInterface
    from rlcore.interfaces.generation import GenerationInterface
    from rlcore.interfaces.policy import ColocatablePolicyInterface, PolicyInterface


class TrainBatches(Protocol):
    """The run's training samples, drawn a batch at a time (``rlcore.datasets``' sources)."""

    @property
    def batch_size(self) -> int: ...

    def batch(self, k: int) -> list[Any]:
        """Batch ``k`` of samples (``rlcore.datasets.Sample``); raises ``rlcore.datasets.DataExhausted`` past the
        last batch the epochs allow."""
        ...

    def epoch_of(self, k: int) -> int:
        """The epoch batch ``k`` belongs to."""
        ...


class RunSamples(Protocol):
    """The run's data (``rlcore.datasets.sources.RunData``)."""

    @property
    def train(self) -> TrainBatches: ...

    @property
    def validation(self) -> Sequence[Any] | None: ...


class WeightSync(Protocol):
    """Keeps the generation engines' weights equal to the policy's (``rlcore.refit.WeightSynchronizer``)."""

    stale: bool  # the policy trained since the last refit: the engines' weights are old

    def sync_weights(self) -> dict[str, float]:
        """Move the policy's weights into the engines (``bytes``: what moved); clears ``stale``."""
        ...


class BatchShape(Protocol):
    """How the policy cuts a global batch (``rlcore.config.BatchPlan``)."""

    @property
    def global_batch_size(self) -> int: ...

    @property
    def micro_batch_size(self) -> int: ...

    @property
    def data_parallel_size(self) -> int: ...

    @property
    def mode(self) -> str:
        """``plain`` (micro-batches of ``micro_batch_size`` rows), ``dynamic`` or ``packing`` (token budgets)."""
        ...


class ResolvedRun(Protocol):
    """What resolution decided (``rlcore.config.ResolvedConfig``)."""

    @property
    def config(self) -> Any: ...  # the RLCoreConfig, every automatic setting written in

    @property
    def async_generation(self) -> bool: ...  # rollouts are generated ahead of training


class RunContext(Protocol):
    """The run an algorithm trains: its pieces, its data position and its step range.

    Pieces a run does not have are None: ``generation``, ``synchronizer`` and ``environment`` for an algorithm
    whose spec says it does not generate (SFT, DPO); ``synchronizer`` too when the training backend generates
    with its own weights; ``teacher`` and ``value_model`` unless the algorithm's resolution asked for one.
    ``generation`` and ``synchronizer`` stand in for the engines: an engine that dies is restarted behind them
    (``policy.generation.engine_restarts_per_step``).
    """

    policy: ColocatablePolicyInterface  # the trained model's workers (rlcore.policy.Policy)
    generation: GenerationInterface | None  # the engines, or the policy itself when its backend generates
    synchronizer: WeightSync | None  # refits the engines; None when nothing is refit
    tokenizer: PreTrainedTokenizerBase  # with the run's chat template installed
    environment: EnvironmentInterface | None  # scores rollouts
    teacher: PolicyInterface | None  # a frozen second model (on-policy distillation's teacher)
    value_model: PolicyInterface | None  # a trained critic with a value head (``get_values``; PPO's), or None
    data: RunSamples
    start_step: int  # the first step this run trains (after a resumed checkpoint's)
    num_steps: int  # steps the run ends at (its algorithm section's max_num_steps, or fewer epochs' worth)
    next_batch: int  # the data position: the next batch draw_train_batch returns

    @property
    def resolved(self) -> ResolvedRun:
        """What resolution decided (read only)."""
        ...

    @property
    def cfg(self) -> Any:
        """The whole config (``resolved.config``)."""
        ...

    @property
    def batch(self) -> BatchShape:
        """How the policy cuts a global batch into ranks and micro-batches."""
        ...

    def draw_train_batch(self) -> list[Any]:
        """The next batch of training samples; moves ``next_batch`` (raises ``rlcore.datasets.DataExhausted``
        past the last batch the epochs allow)."""
        ...


__all__ = ["BatchShape", "ResolvedRun", "RunContext", "RunSamples", "TrainBatches", "WeightSync"]
