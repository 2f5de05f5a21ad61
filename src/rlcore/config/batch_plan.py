"""``BatchPlan``: how the policy cuts a global batch, decided once when a config is resolved.

A global batch of ``gbs`` samples is one optimizer step (design.md §2.4). It is
split over the data-parallel ranks, ``gbs / dp`` samples each; a rank runs them
in micro-batches of ``mbs`` samples (plain batching, so ``gbs / (dp * mbs)``
gradient-accumulation steps), or of at most a token budget (dynamic batching
and sequence packing, where ``mbs`` plays no part). :func:`batch_problems` is
the one place that invariant is checked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

BatchingMode = Literal["plain", "dynamic", "packing"]


def batch_problems(
    gbs: int,
    mbs: int,
    dp: int,
    mode: BatchingMode,
    *,
    gbs_name: str = "policy.train_global_batch_size",
    mbs_name: str = "policy.train_micro_batch_size",
) -> list[str]:
    """Whether a global batch of ``gbs`` splits into whole per-rank shards (and, plain, whole micro-batches)."""
    if mode != "plain":
        if gbs % dp:
            return [f"{gbs_name}: {gbs} is not divisible by the data-parallel size {dp}; set it to a multiple of {dp}"]
        return []
    step = dp * mbs
    if gbs % step:
        return [
            f"{gbs_name}: {gbs} is not divisible by data-parallel size {dp} × {mbs_name} {mbs} = {step}; "
            f"set {gbs_name} to a multiple of {step} or change {mbs_name}"
        ]
    return []


@dataclass(frozen=True)
class BatchPlan:
    """The batch arithmetic of one policy (see the module docstring)."""

    global_batch_size: int
    micro_batch_size: int
    logprob_batch_size: int
    data_parallel_size: int
    mode: BatchingMode
    train_mb_tokens: int  # token budget of a training micro-batch (dynamic batching, packing)
    logprob_mb_tokens: int  # token budget of a logprob micro-batch (dynamic batching, packing)
    sequence_length_round: int  # dynamic batching rounds each sequence's length up to a multiple of this
    packing_algorithm: str

    @classmethod
    def of(cls, policy: Any, data_parallel_size: int, packing: bool) -> BatchPlan:
        """The plan of a validated ``PolicyConfig`` at ``data_parallel_size``; ``packing``: whether it packs."""
        db, sp = policy.dynamic_batching, policy.sequence_packing
        budgets = db if db.enabled else sp
        seq = policy.max_total_sequence_length
        return cls(
            global_batch_size=policy.train_global_batch_size,
            micro_batch_size=policy.train_micro_batch_size,
            logprob_batch_size=policy.logprob_batch_size,
            data_parallel_size=data_parallel_size,
            mode="dynamic" if db.enabled else ("packing" if packing else "plain"),
            train_mb_tokens=budgets.train_mb_tokens or policy.train_micro_batch_size * seq,
            logprob_mb_tokens=budgets.logprob_mb_tokens or policy.logprob_batch_size * seq,
            sequence_length_round=db.sequence_length_round,
            packing_algorithm=sp.algorithm,
        )

    @property
    def samples_per_rank(self) -> int:
        """Samples of one global batch on each data-parallel rank."""
        return self.global_batch_size // self.data_parallel_size

    @property
    def gradient_accumulation_steps(self) -> int | None:
        """Micro-batches per rank and optimizer step (plain batching; a token budget decides otherwise)."""
        return self.samples_per_rank // self.micro_batch_size if self.mode == "plain" else None

    def problems(self) -> list[str]:
        return batch_problems(self.global_batch_size, self.micro_batch_size, self.data_parallel_size, self.mode)

    def shard_args(self, purpose: Literal["train", "logprob"]) -> dict[str, Any]:
        """Keyword arguments of ``BatchedDataDict.shard_by_batch_size`` for a training or a logprob pass."""
        tokens = self.train_mb_tokens if purpose == "train" else self.logprob_mb_tokens
        if self.mode == "dynamic":
            return {
                "dynamic_batching_args": {
                    "max_tokens_per_microbatch": tokens,
                    "sequence_length_round": self.sequence_length_round,
                }
            }
        if self.mode == "packing":
            return {"sequence_packing_args": {"max_tokens_per_microbatch": tokens, "algorithm": self.packing_algorithm}}
        return {}
