"""Dynamic batching: token-budgeted micro-batches, in lockstep across dp shards.

With fixed-size micro-batches every micro-batch is padded to its longest
sample, so one long sample makes the whole micro-batch expensive. Dynamic
batching instead groups samples of similar length and sizes each micro-batch
by a token budget, so short samples travel many at a time and long ones few
at a time.

Data-parallel ranks under FSDP run collectives inside every forward and
backward, so all ranks must run the *same number* of micro-batches in a step,
or the ranks with more would wait forever. :func:`plan_dynamic_microbatches`
therefore plans all shards together. Pure Python, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


def round_up(n: int, multiple: int, at_most: int | None = None) -> int:
    """``n`` rounded up to a multiple of ``multiple`` (at least one multiple), but not past ``at_most``
    (a batch's width: NeMo-RL never pads beyond it either)."""
    m = max(1, int(multiple))
    rounded = max(m, -(-int(n) // m) * m)
    return rounded if at_most is None else min(rounded, int(at_most))


@dataclass
class MicroBatchPlan:
    """Micro-batches of one shard for one step.

    ``micro_batches[j]`` lists the shard-local sample indices of micro-batch
    ``j`` (longest first); ``padded_lengths[j]`` is the sequence length it is
    padded (or truncated) to. ``len(micro_batches[j]) * padded_lengths[j]``
    never exceeds the token budget.
    """

    micro_batches: list[list[int]] = field(default_factory=list)
    padded_lengths: list[int] = field(default_factory=list)


def balanced_assignment(lengths: Sequence[int], n_shards: int) -> list[list[int]]:
    """Deal samples to shards longest-first in snake order (0,1,..,n-1,n-1,..,0).

    Each shard gets ``len(lengths) / n_shards`` samples (the caller makes it
    divisible) covering the same spread of lengths, so the per-shard
    micro-batch plans come out nearly identical (same count, same padded
    lengths) and the shards carry similar token totals.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    shards: list[list[int]] = [[] for _ in range(n_shards)]
    for pos, i in enumerate(order):
        row, col = divmod(pos, n_shards)
        shards[col if row % 2 == 0 else n_shards - 1 - col].append(i)
    return shards


def _greedy(lengths: Sequence[int], max_tokens: int) -> MicroBatchPlan:
    """Longest first; a micro-batch is padded to its first (longest) sample."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    plan = MicroBatchPlan()
    for i in order:
        if plan.micro_batches:
            mb, pad = plan.micro_batches[-1], plan.padded_lengths[-1]
            if (len(mb) + 1) * pad <= max_tokens:
                mb.append(i)
                continue
        plan.micro_batches.append([i])
        plan.padded_lengths.append(lengths[i])
    return plan


def _split_largest(plan: MicroBatchPlan, lengths: Sequence[int]) -> None:
    """Split the micro-batch with the most samples into two halves, in place.

    Both halves stay sorted longest-first and each is padded to its own
    longest sample, so the budget still holds.
    """
    j = max(range(len(plan.micro_batches)), key=lambda k: (len(plan.micro_batches[k]), -k))
    mb = plan.micro_batches[j]
    half = (len(mb) + 1) // 2
    first, second = mb[:half], mb[half:]
    plan.micro_batches[j : j + 1] = [first, second]
    plan.padded_lengths[j : j + 1] = [lengths[first[0]], lengths[second[0]]]


def plan_dynamic_microbatches(
    shard_lengths: Sequence[Sequence[int]],
    max_tokens: int,
    sequence_length_round: int = 1,
    align_lengths: bool = True,
    max_length: int | None = None,
) -> list[MicroBatchPlan]:
    """Plan token-budgeted micro-batches for every dp shard of one step.

    Algorithm:

    1. Round every length up to a multiple of ``sequence_length_round``
       (kernels and tensor/sequence parallelism like aligned shapes), but
       never past ``max_length``, the batch's width (as NeMo-RL caps it).
    2. Per shard, sort samples longest first and fill micro-batches greedily:
       a sample joins the current micro-batch while
       ``(count + 1) * padded_length <= max_tokens``, where the padded length
       is that of the micro-batch's first (longest) sample. Sorting makes
       samples of similar length share a micro-batch, so little is padded.
    3. Lockstep: let ``K`` be the largest micro-batch count over shards. On
       every other shard, split the micro-batch holding the most samples in
       two until it has ``K``. Splitting never raises a padded length, so the
       budget keeps holding. (Needs ``K <= `` every shard's sample count,
       which holds when the shards have equal sizes.)
    4. With ``align_lengths``, micro-batch ``j`` of every shard is padded to
       the largest padded length of micro-batch ``j`` over the shards, on each
       shard where that still fits the budget.

    Guarantees: every sample is in exactly one micro-batch; every shard has
    the same number of micro-batches; ``count * padded_length <= max_tokens``
    for every micro-batch; padded lengths are multiples of
    ``sequence_length_round`` (or ``max_length``) and equal across shards for index ``j``
    whenever step 4 could align them (with shards dealt by
    :func:`balanced_assignment` they nearly always are).

    Raises ``ValueError`` if a single rounded sample exceeds ``max_tokens``
    or the shards cannot all reach the same count.
    """
    if max_tokens <= 0:
        raise ValueError(f"max_tokens_per_microbatch must be positive, got {max_tokens}")
    rounded = [[round_up(n, sequence_length_round, max_length) for n in lens] for lens in shard_lengths]
    for r, lens in enumerate(rounded):
        for i, n in enumerate(lens):
            if n > max_tokens:
                raise ValueError(
                    f"sample {i} of shard {r} has length {shard_lengths[r][i]} (rounded to "
                    f"{n}), more than max_tokens_per_microbatch={max_tokens}"
                )
    plans = [_greedy(lens, max_tokens) for lens in rounded]
    target = max((len(p.micro_batches) for p in plans), default=0)
    for r, (plan, lens) in enumerate(zip(plans, rounded)):
        if len(lens) < target:
            raise ValueError(
                f"shard {r} has {len(lens)} samples but another shard needs {target} "
                "micro-batches; shards must have equal sizes for lockstep micro-batches"
            )
        while len(plan.micro_batches) < target:
            _split_largest(plan, lens)
    if align_lengths and plans:
        for j in range(target):
            common = max(p.padded_lengths[j] for p in plans)
            for p in plans:
                if len(p.micro_batches[j]) * common <= max_tokens:
                    p.padded_lengths[j] = common
    return plans
