"""Step plans: which rows each data-parallel shard gets in each optimizer step, cut into which micro-batches.

:meth:`BatchedDataDict.shard_by_batch_size <rlcore.data.BatchedDataDict.shard_by_batch_size>` asks this
module for the plan and only applies it to its rows. :func:`check_step_split` checks that the batch splits
into whole steps, shards and groups; :func:`plan_args` checks and fills in the dynamic-batching or packing
arguments; :func:`plan_shards` plans every step in one of three modes: plain (equal contiguous slices),
dynamic batching (rows dealt by length, token-budgeted micro-batches in lockstep over the shards) or
sequence packing (bins of rows dealt out, the same bin count on every shard). Rows that form a group
(``group_size``, e.g. DPO's chosen/rejected pairs) are planned as one unit, so a group always lands on one
shard, in one micro-batch, with its rows consecutive and in their original order. Pure Python on row
indices and lengths, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlcore.data.dynamic_batching import balanced_assignment, plan_dynamic_microbatches, round_up
from rlcore.data.packing import pack_sequences

DYNAMIC_KEYS = {"max_tokens_per_microbatch", "sequence_length_round", "input_key", "input_lengths_key"}
PACKING_KEYS = DYNAMIC_KEYS | {"algorithm", "sequence_length_pad_multiple"}


@dataclass
class ShardPlan:
    """One shard's rows over all steps.

    ``rows`` are the original row indices in shard order. With dynamic batching or packing,
    ``micro_batch_indices[k]`` are the ``(start, end)`` ranges (into ``rows``) of step ``k``'s micro-batches
    and ``micro_batch_lengths[k]`` their padded lengths or packed token counts; both are ``None`` in plain
    mode.
    """

    rows: list[int]
    micro_batch_indices: list[list[tuple[int, int]]] | None = None
    micro_batch_lengths: list[list[int]] | None = None


def check_step_split(
    total: int,
    batch_size: int | None,
    shards: int,
    group_size: int,
    dynamic_batching_args: dict[str, Any] | None,
    sequence_packing_args: dict[str, Any] | None,
) -> tuple[int, int]:
    """``(batch_size, group_size)`` as ints, once ``total`` rows split into whole steps, shards and groups.

    Plain mode and dynamic batching give each shard the same number of whole groups per step, so the step
    size must be a multiple of ``group_size * shards``; packing deals bins, so a multiple of ``group_size``.
    """
    if dynamic_batching_args is not None and sequence_packing_args is not None:
        raise ValueError("dynamic batching and sequence packing are mutually exclusive")
    if total == 0:
        raise ValueError("cannot shard an empty batch")
    bs = total if batch_size is None else int(batch_size)
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    if bs < 1 or total % bs:
        raise ValueError(f"batch of {total} samples is not a whole number of global batches of {batch_size}")
    if bs % shards:
        raise ValueError(
            f"global batch of {bs} samples cannot be split evenly over {shards} data-parallel "
            "shards; pad the batch (e.g. with sample_mask=0 rows) to a multiple of the dp size"
        )
    g = int(group_size)
    if g < 1:
        raise ValueError(f"group_size must be >= 1, got {g}")
    whole_groups_per_shard = sequence_packing_args is None  # packing deals bins, not equal row counts
    if bs % (g * shards if whole_groups_per_shard else g):
        need = f"{g} (group_size) × {shards} (shards)" if whole_groups_per_shard else f"{g} (group_size)"
        raise ValueError(
            f"global batch of {bs} samples in groups of {g} rows that must stay together cannot be split "
            f"into whole groups per shard; the global batch size must be a multiple of {need}"
        )
    return bs, g


def plan_args(
    dynamic_batching_args: dict[str, Any] | None, sequence_packing_args: dict[str, Any] | None
) -> dict[str, Any] | None:
    """The mode's arguments checked and with their defaults (packing also gets ``algorithm``); None in plain
    mode."""
    if dynamic_batching_args is not None:
        return _check_args("dynamic_batching_args", dynamic_batching_args, DYNAMIC_KEYS)
    if sequence_packing_args is not None:
        args = _check_args("sequence_packing_args", sequence_packing_args, PACKING_KEYS)
        args.setdefault("algorithm", "modified_first_fit_decreasing")
        return args
    return None


def _check_args(name: str, args: dict, allowed: set[str]) -> dict:
    unknown = set(args) - allowed
    if unknown:
        raise ValueError(f"unknown {name} keys {sorted(unknown)}; valid keys: {sorted(allowed)}")
    if "max_tokens_per_microbatch" not in args:
        raise ValueError(f"{name} needs 'max_tokens_per_microbatch'")
    out = {"sequence_length_round": 1, "input_key": "input_ids", "input_lengths_key": "input_lengths"}
    out.update(args)
    if "sequence_length_pad_multiple" in out:  # NeMo-RL's name for it in sequence_packing_args
        multiple = out.pop("sequence_length_pad_multiple")
        if "sequence_length_round" in args and args["sequence_length_round"] != multiple:
            raise ValueError(
                f"{name}: sequence_length_round={args['sequence_length_round']} and "
                f"sequence_length_pad_multiple={multiple} name the same setting; give one"
            )
        out["sequence_length_round"] = multiple
    return out


def plan_shards(
    total: int,
    batch_size: int,
    shards: int,
    group_size: int,
    args: dict[str, Any] | None = None,
    packing: bool = False,
    lengths: list[int] | None = None,
    width: int | None = None,
) -> list[ShardPlan]:
    """Plan ``total`` rows, in steps of ``batch_size``, over ``shards`` shards (sizes checked beforehand by
    :func:`check_step_split`).

    ``args`` (from :func:`plan_args`) ``None`` is plain mode; otherwise ``lengths`` gives each row's length
    and ``packing`` picks packing over dynamic batching. ``width`` (the padded sequence width, or None) caps
    the padded lengths of dynamic batching.
    """
    bs, g = batch_size, group_size
    plans = [ShardPlan([]) if args is None else ShardPlan([], [], []) for _ in range(shards)]
    for k in range(total // bs):
        step = list(range(k * bs, (k + 1) * bs))
        if args is None:
            per = bs // shards
            for r in range(shards):
                plans[r].rows += step[r * per : (r + 1) * per]
            continue
        assert lengths is not None
        units = [step[u : u + g] for u in range(0, bs, g)]
        if packing:
            step_plans = plan_packed_step(units, lengths, shards, args)
        else:
            step_plans = plan_dynamic_step(units, lengths, shards, args, width)
        for plan, (mbs, mb_lens) in zip(plans, step_plans):
            assert plan.micro_batch_indices is not None and plan.micro_batch_lengths is not None
            step_ranges = []
            for mb in mbs:
                step_ranges.append((len(plan.rows), len(plan.rows) + len(mb)))
                plan.rows += mb
            plan.micro_batch_indices.append(step_ranges)
            plan.micro_batch_lengths.append(mb_lens)
    return plans


def plan_dynamic_step(
    units: list[list[int]], lengths: list[int], shards: int, args: dict, width: int | None
) -> list[tuple[list[list[int]], list[int]]]:
    """Per shard: micro-batches (original indices) and padded lengths (rounded, at most ``width``).

    ``units`` are the step's groups (single rows without grouping). A unit of ``g`` rows is as long as
    its longest row and takes ``g`` padded rows of a micro-batch, so planning units against
    ``budget // g`` keeps ``rows * padded_length <= budget``.
    """
    budget = int(args["max_tokens_per_microbatch"])
    rnd = int(args["sequence_length_round"])
    g = len(units[0])
    unit_lens = [max(lengths[i] for i in unit) for unit in units]
    for unit, n in zip(units, unit_lens):
        if g * round_up(n, rnd, width) > budget:
            what = f"sample {unit[0]}" if g == 1 else f"group of samples {unit} (kept together)"
            raise ValueError(
                f"{what} has length {n} (rounded to a multiple of {rnd})"
                + ("" if g == 1 else f", {g} rows of it")
                + f", more than max_tokens_per_microbatch={budget}"
            )
    dealt = balanced_assignment(unit_lens, shards)
    plans = plan_dynamic_microbatches([[unit_lens[u] for u in d] for d in dealt], budget // g, rnd, max_length=width)
    return [
        ([[i for j in mb for i in units[d[j]]] for mb in p.micro_batches], p.padded_lengths)
        for d, p in zip(dealt, plans)
    ]


def plan_packed_step(
    units: list[list[int]], lengths: list[int], shards: int, args: dict
) -> list[tuple[list[list[int]], list[int]]]:
    """Per shard: bins (original indices) and their packed token counts.

    ``units`` are the step's groups (single rows without grouping); a unit is packed whole, as long as
    the sum of its rows' rounded lengths.
    """
    cap = int(args["max_tokens_per_microbatch"])
    rnd = int(args["sequence_length_round"])
    # Ceil to the multiple, 0 stays 0: what pack_microbatch(pad_to_multiple=rnd) allocates.
    unit_lens = [sum(-(-lengths[i] // rnd) * rnd for i in unit) for unit in units]
    for unit, n in zip(units, unit_lens):
        if n > cap:
            raw = sum(lengths[i] for i in unit)
            what = (
                f"sample {unit[0]} has length"
                if len(unit) == 1
                else f"group of samples {unit} (kept together) has total length"
            )
            raise ValueError(
                f"{what} {raw}"
                + (f" (rounded to {n})" if n != raw else "")
                + f", longer than the packing capacity max_tokens_per_microbatch={cap}"
            )
    bins = pack_sequences(unit_lens, cap, args["algorithm"], min_bin_count=shards, bin_count_multiple=shards)
    loads = [sum(unit_lens[u] for u in b) for b in bins]
    # Deal bins heaviest first in snake order so the shards' token totals match.
    dealt = balanced_assignment(loads, shards)
    return [([[i for u in bins[b] for i in units[u]] for b in d], [loads[b] for b in d]) for d in dealt]
