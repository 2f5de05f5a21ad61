"""DAPO's dynamic sampling (``grpo.use_dynamic_sampling``): generate until a step holds
``grpo.num_prompts_per_step`` groups whose rewards differ, and train on those.

A group whose ``num_generations_per_prompt`` rewards all agree (every answer right, or every answer
wrong) has zero advantage at every token: it costs a training pass and teaches nothing. A step therefore
draws generation batches of ``int(num_prompts_per_step * batch_multiplier)`` prompts one after another,
keeps each batch's groups with signal, and stops as soon as it holds enough; the surplus groups of the
last batch are dropped (counted in ``dynamic_sampling/discarded_valid_samples``). Signal is judged on the
rewards after ``grpo.reward_scaling`` and before ``grpo.reward_shaping``, as in NeMo-RL, so that a length
penalty does not make a group look informative. A step that has drawn ``dynamic_sampling_max_gen_batches``
batches without finding enough groups stops the run with an error that says what to change.

Every batch drawn moves the run's data position (:attr:`rlcore.run.build.Run.next_batch`, recorded by each
checkpoint), so a resumed run continues with the next unseen batch; when ``grpo.max_num_epochs`` runs out
inside a step, the run ends after the step before it.

Where it differs from NeMo-RL (``dynamic_sampling`` in ``nemo_rl/algorithms/grpo.py``): whole groups are
kept or dropped (NeMo-RL filters samples by a per-sample std, which with ``use_leave_one_out_baseline`` can
split a group); a step draws at most ``dynamic_sampling_max_gen_batches`` batches (NeMo-RL's check lets it
draw one more); a group whose prompt was cut at ``data.max_input_seq_length`` is never kept, whatever its
rewards (NeMo-RL keeps it when they differ, and then trains a step with fewer samples: its loss multiplier is 0).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlcore.datasets import Sample
    from rlcore.run.rollouts import Rollout


#: Rollout metrics that count things, added up over a step's generation batches (the others are means).
SUMMED_METRICS = ("env/errors", "env/nonfinite_rewards", "cut_prompts")


class DynamicSamplingError(RuntimeError):
    """A step found too few groups with signal within ``grpo.dynamic_sampling_max_gen_batches`` batches."""


def sample_with_signal(
    cfg: Any, draw: Callable[[], list[Sample]], roll_out: Callable[[list[Sample]], Rollout], pad: int
) -> tuple[Rollout, dict[str, float]]:
    """Draw and roll out batches until ``num_prompts_per_step`` groups have signal.

    ``draw()``: the next batch of samples (moves the data position); ``roll_out(samples)``: their scored
    rollout, ``num_generations_per_prompt`` trajectories per sample. Returns the rollout of exactly
    ``num_prompts_per_step`` groups (in the order they were generated) and the step's sampling metrics:
    ``reward_mean`` / ``reward_std`` over every generated sample (what the policy scores, comparable with a
    run without dynamic sampling), ``filtered_reward_mean`` over the trained ones.
    """
    import torch

    from rlcore.algorithms.grpo.reward_transforms import groups_with_signal, transform_rewards

    g = cfg.grpo
    size, wanted = g.num_generations_per_prompt, g.num_prompts_per_step
    generated: list[Rollout] = []
    kept: list[Rollout] = []
    found = cut = 0
    while found < wanted:
        if len(generated) == g.dynamic_sampling_max_gen_batches:
            raise DynamicSamplingError(
                f"grpo.dynamic_sampling_max_gen_batches: {len(generated)} generation batches of "
                f"{g.prompts_per_generation_batch} prompts gave {found} of the {wanted} groups "
                "(grpo.num_prompts_per_step) whose rewards differ; "
                + (f"{cut} had their prompt cut at data.max_input_seq_length, and " if cut else "")
                + "every other group's rewards agree, so the task "
                "is too easy or too hard for the policy; raise dynamic_sampling_max_gen_batches, "
                "batch_multiplier or num_generations_per_prompt, or lower num_prompts_per_step"
            )
        rollout = roll_out(draw())
        generated.append(rollout)
        unshaped = transform_rewards(
            g, rollout.rewards, rollout.data["first_turn_lengths"], rollout.data["truncated"]
        ).unshaped
        cut_groups = _cut_groups(rollout, size)
        cut += int(cut_groups.sum())
        signal = groups_with_signal(unshaped, size) & ~cut_groups
        groups = signal.nonzero().flatten().tolist()
        if groups:
            kept.append(_select_groups(rollout, groups, size))
            found += len(groups)
    trained = _concatenate(kept, wanted * size, pad)
    everything = torch.cat([r.rewards for r in generated])
    metrics = {
        "reward_mean": float(everything.mean()),
        "reward_std": float(everything.std()) if everything.numel() > 1 else 0.0,
        "filtered_reward_mean": float(trained.rewards.mean()),
        "dynamic_sampling/gen_batches": float(len(generated)),
        "dynamic_sampling/groups_with_signal_fraction": found / (everything.numel() // size),
        "dynamic_sampling/discarded_valid_samples": float((found - wanted) * size),
        "dynamic_sampling/generated_tokens": float(sum(int(r.data["generation_lengths"].sum()) for r in generated)),
    }
    trained.metrics = _merged_rollout_metrics(generated)
    return trained, metrics


def _cut_groups(rollout: Rollout, size: int) -> Any:
    """``[groups]`` (bool): the group's prompt was cut at ``data.max_input_seq_length`` (it trains nothing)."""
    import torch

    cut = rollout.data.get("prompt_cut")
    if cut is None:
        return torch.zeros(rollout.rewards.numel() // size, dtype=torch.bool)
    return cut.view(-1, size).any(dim=1)


def _select_groups(rollout: Rollout, groups: list[int], size: int) -> Rollout:
    from rlcore.run.rollouts import Rollout

    rows = [row for group in groups for row in range(group * size, (group + 1) * size)]
    return Rollout(rollout.data.select_indices(rows), rollout.rewards[rows])


def _concatenate(parts: list[Rollout], rows: int, pad: int) -> Rollout:
    """The first ``rows`` trajectories of ``parts``, as one batch no wider than its longest sequence."""
    import torch

    from rlcore.data import BatchedDataDict
    from rlcore.run.rollouts import Rollout

    data = BatchedDataDict.from_batches([p.data for p in parts], pad_value_dict={"output_ids": pad}).slice(0, rows)
    width = int(data["unpadded_sequence_lengths"].max())
    for key, value in list(data.items()):
        if isinstance(value, torch.Tensor) and value.dim() == 2:
            data[key] = value[:, :width]
    return Rollout(data, torch.cat([p.rewards for p in parts])[:rows])


def _merged_rollout_metrics(rollouts: list[Rollout]) -> dict[str, float | str]:
    """The batches' rollout metrics as one step's: environment errors add up, the rest are means over batches
    (of equal size); a text (``env/first_error``, only where a batch had one) is the first batch's."""
    merged: dict[str, float | str] = {}
    for key in dict.fromkeys(k for r in rollouts for k in r.metrics):
        values = [r.metrics[key] for r in rollouts if key in r.metrics]
        if isinstance(values[0], str):
            merged[key] = values[0]
        else:
            total = sum(values)
            merged[key] = total if key in SUMMED_METRICS else total / len(values)
    return merged
