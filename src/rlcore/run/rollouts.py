"""Rollouts: generate for a batch of samples, let the environment answer, and score, over one or more turns.

A turn generates for every sample still going, appends each completion to its
message log as an ``assistant`` message and steps the environment on the
logs. The environment's reward adds to the sample's total (NeMo-RL's
semantics: a multi-turn episode's reward is the sum of its turns'), and so
does each named reward component it returns; a sample
ends when the environment says it is done, after ``grpo.max_rollout_turns``
turns, or when its sequence has no room left within
``policy.max_total_sequence_length``. A sample that goes on gets the
environment's observation appended (:mod:`rlcore.chat.observations`): one of
role ``environment`` as NeMo-RL does, its content tokenized as is (no special
tokens added; an environment that talks to a chat model writes its template's
turn markers into the content); one with a chat role (``user``, ``tool``,
``system``), or a list of such ``messages``, through the chat template after
the generated assistant turn (:func:`rlcore.chat.templates.appended_ids`), so
the next turn reads as the template renders it without any earlier turn being
re-encoded. The log keeps the observation's messages with their roles. The
next turn's stop strings come from the environment. An environment's ``tools``
(OpenAI function schemas) go to the chat template with the first prompt.

The trajectory is one token sequence per sample: the prompt, then each turn's
completion and observation. ``token_mask`` marks the generated tokens, the
only ones trained (observations are context, like the prompt), and
``logprobs`` holds the engine's logprob of each generated token at its
position, so the loss compares it with the policy's token by token across
turns. The next turn is generated from these very token ids (never from
re-rendered text), so what the policy scores is exactly what the engine saw.
``invalid_tool_call_mask`` marks the generated tokens of the turns the
environment flagged (``invalid_tool_calls``: a malformed tool call). Numbers
an environment reports about each sample's turn (``metrics``) are summed per
sample over its turns and logged as ``env/<name>_per_sample``
(:func:`rlcore.interfaces.environment.environment_metrics`).

A prompt of ``data.max_input_seq_length`` tokens or more is cut as NeMo-RL cuts it
(:func:`rlcore.run.prompts.cut_long_prompts`) and rolled out like any other; its
trajectories carry ``prompt_cut`` (the training batch masks them out of the loss) and
the rollout's ``cut_prompts`` metric counts such prompts (not their copies).

Each generation request carries its own sampling seed (``sampling_seeds``, design.md §2.1): a pure function of the
run's seed, the training step, the sample's data row, its copy and the turn (:func:`sampling_seed`), never of an
engine's running random state. An engine that honours the key samples the same completion from the same weights
whenever the request is made again, which is what lets a resumed run reproduce the steps it re-runs
(docs/reproducibility.md).
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rlcore.run.image_prompts import IMAGE_KEYS, TRAINED_IMAGE_KEYS

if TYPE_CHECKING:
    import torch

    from rlcore.chat.observations import ChatContext
    from rlcore.datasets import Sample
    from rlcore.run.step import Timer


@dataclass
class Rollout:
    """The scored trajectories of one batch (``repeat`` per sample, in sample order), ready to train on.

    ``data``: ``output_ids`` / ``logprobs`` / ``token_mask`` ``[B, T]`` (right-padded), ``input_lengths``
    (the first prompt's length), ``unpadded_sequence_lengths``, ``generation_lengths`` (generated tokens, all
    turns), ``first_turn_lengths`` (the first completion's) and ``truncated`` (a completion or observation cut by
    a token budget) ``[B]``; with an asynchronous engine also ``weight_version`` (the oldest weights any turn
    used) and ``generation_window``; with an 'in_flight_weight_updates' engine also ``generation_weight_versions``
    ``[B, T]`` (the version that generated each token, -1 at prompt, observation and padding positions); with an
    environment that returns named reward components, ``reward/<name>`` ``[B]`` for each (summed over turns
    like ``rewards``; NeMo-RL's batch keys), which GDPO reads; ``prompt_cut``
    ``[B]`` (bool): the prompt was cut at ``data.max_input_seq_length``, so the sample trains nothing;
    ``invalid_tool_call_mask`` ``[B, T]`` (bool): the generated tokens of the turns whose tool calls the environment
    flagged invalid (``EnvironmentReturn.invalid_tool_calls``).
    """

    data: Any
    rewards: Any
    metrics: dict[str, float | str] = field(default_factory=dict)  # env/first_error: text


#: The training step whose rollouts are being generated (None outside a step, e.g. on a thread of its own).
_ROLLOUT_STEP: ContextVar[int | None] = ContextVar("rlcore_rollout_step", default=None)


@contextmanager
def rollout_step(step: int) -> Iterator[None]:
    """Rollouts made inside the block belong to training step ``step``: their sampling seeds include it, so a
    data row drawn again in a later epoch is not sampled with the same seeds."""
    token = _ROLLOUT_STEP.set(step)
    try:
        yield
    finally:
        _ROLLOUT_STEP.reset(token)


def sampling_seed(run_seed: int, step: int | None, row: int, copy: int, turn: int) -> int:
    """The seed of one generation request: a 63-bit digest of the run's seed, the step (None: not known), the
    sample's data row, which of its ``repeat`` copies, and the turn. The same request, made again after a resume,
    gets the same seed; distinct requests of a run get unrelated ones."""
    key = f"rlcore-sampling/{run_seed}/{step}/{row}/{copy}/{turn}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") >> 1


def run_rollout(
    cfg: Any,
    generate: Callable[[Any], Any],
    environment: Any,
    tokenizer: Any,
    samples: list[Sample],
    repeat: int,
    timer: Timer,
    *,
    generation: Any | None = None,
    greedy: bool = False,
) -> Rollout:
    """Roll out ``samples`` (each ``repeat`` times) for up to ``grpo.max_rollout_turns`` turns;
    ``generate(batch) -> output`` is the engine call (sampling or greedy).

    ``generation``: the backend behind ``generate``. When it serves requests continuously (its
    ``continuous_serving``), each sample group is rolled out on its own and handled as it finishes
    (:func:`rlcore.run.group_rollouts.roll_out_ready_first`, sampling greedily with ``greedy``); the rollout is
    the same as the whole-batch turns give for the same completions. Otherwise (or None) every turn is one
    ``generate`` call over all the samples still going."""
    import torch

    from rlcore.interfaces.generation import serves_continuously
    from rlcore.run.image_prompts import image_model_of
    from rlcore.run.prompts import pad_id
    from rlcore.run.step import encode_samples, max_input_of

    first = encode_samples(cfg, tokenizer, samples, repeat, tools=getattr(environment, "tools", None))
    image_model = image_model_of(cfg)
    state = Trajectories(
        first,
        [dict(s.metadata) for s in samples for _ in range(repeat)],
        [[*s.messages] for s in samples for _ in range(repeat)],
        cut_before=image_model.placeholder_ids if image_model is not None else frozenset(),
    )
    turns = RolloutTurns(cfg, state, environment, tokenizer, samples, repeat)
    if serves_continuously(generation):  # a stand-in without the property: whole batches
        from rlcore.run.group_rollouts import roll_out_ready_first

        roll_out_ready_first(turns, generation, greedy, timer)
    else:
        for turn in range(turns.max_turns):
            active = state.active()
            if not active:
                break
            batch = turns.request(active, turn)
            with timer.phase("generation"):
                out = generate(batch)
            turns.take(active, batch, out)
            turns.score(active, turn, timer)
    # the first failed sample: the earliest turn, then sample order
    metrics: dict[str, float | str] = error_metrics(turns.sorted_errors())
    if image_model is not None:  # completions that wrote an image's placeholder, cut before it
        metrics["image_placeholder_cuts"] = float(state.placeholder_cuts)
    if max_input_of(cfg) is not None:  # the prompts (not their copies) cut at data.max_input_seq_length
        metrics["cut_prompts"] = float(state.prompt_cut.sum()) / repeat
    if turns.max_turns > 1:
        metrics.update(state.turn_metrics())
    if state.env_metrics:  # an environment's numbers per sample and turn (a tools environment's calls)
        from rlcore.interfaces.environment import environment_metrics

        metrics.update(environment_metrics(state.env_metrics))
    data = state.padded(pad_id(tokenizer))
    if "weight_version" in data:  # the oldest weights (vLLM's word) any of the step's samples was generated with
        metrics["weight_version"] = float(data["weight_version"].min())
    return Rollout(data, torch.tensor(state.rewards, dtype=torch.float32), metrics)


@dataclass
class TrajectoryTensors:
    """Each trajectory's token-level tensors (``tokens``, the generated-token ``mask``, the engine's ``logprobs``,
    the ``invalid_calls`` flags) and per-sample facts, before they are padded into one batch."""

    tokens: list[torch.Tensor]
    mask: list[torch.Tensor]
    logprobs: list[torch.Tensor]
    invalid_calls: list[torch.Tensor]
    prompt_lengths: torch.Tensor
    first_turn: list[int]
    truncated: list[bool]
    prompt_cut: torch.Tensor


def padded_trajectories(t: TrajectoryTensors, pad: int) -> Any:
    """The keys every rollout gives, one right-padded batch (:class:`Rollout`); both the turn loop's and the agent
    rollouts' trajectories end here."""
    import torch
    from torch.nn.utils.rnn import pad_sequence

    from rlcore.data import BatchedDataDict

    mask = pad_sequence(t.mask, batch_first=True)
    return BatchedDataDict(
        output_ids=pad_sequence(t.tokens, batch_first=True, padding_value=pad),
        logprobs=pad_sequence(t.logprobs, batch_first=True),
        token_mask=mask,
        input_lengths=t.prompt_lengths,
        unpadded_sequence_lengths=torch.tensor([len(seq) for seq in t.tokens], dtype=torch.long),
        generation_lengths=mask.sum(dim=1).long(),
        truncated=torch.tensor(t.truncated),
        first_turn_lengths=torch.tensor(t.first_turn, dtype=torch.long),
        prompt_cut=t.prompt_cut,
        invalid_tool_call_mask=pad_sequence(t.invalid_calls, batch_first=True),
    )


def error_metrics(errors: list[tuple[str, str]]) -> dict[str, float | str]:
    """A rollout's ``env/`` error metrics from its failed samples, ``(named by data row, error)`` in order: the first
    three are printed to the run's log, all are counted, the first is ``env/first_error``."""
    from rlcore.environments.scoring import NONFINITE_REWARD

    for _, error in errors[:3]:
        print(f"environment error (reward 0): {error}", file=sys.stderr)
    metrics: dict[str, float | str] = {
        "env/errors": float(len(errors)),
        "env/nonfinite_rewards": float(sum(e.startswith(NONFINITE_REWARD) for _, e in errors)),
    }
    if errors:
        metrics["env/first_error"] = errors[0][0]
    return metrics


class RolloutTurns:
    """One turn's work for some of the samples, whichever path calls it: the request (tokens so far, stop
    strings, seeds), taking the engine's output, and the environment's answer. The environment's errors are
    kept with their turn and sample, so both paths report them in the same order."""

    def __init__(
        self, cfg: Any, state: Trajectories, environment: Any, tokenizer: Any, samples: list[Sample], repeat: int
    ) -> None:
        from rlcore.chat.observations import ChatContext
        from rlcore.run.prompts import pad_id
        from rlcore.run.step import loop_setting

        self.max_turns = loop_setting(cfg, "max_rollout_turns", 1)  # GRPO's, distillation's; 1 without one
        self.run_seed, self.step = loop_setting(cfg, "seed", 0) or 0, _ROLLOUT_STEP.get()
        self.max_total = cfg.policy.max_total_sequence_length
        self.pad = pad_id(tokenizer)
        self.state, self.environment, self.tokenizer = state, environment, tokenizer
        self.samples, self.repeat = samples, repeat
        self.errors: list[tuple[int, int, str, str]] = []  # (turn, sample, "data row N: error", error)
        tokenizer_cfg = getattr(cfg.policy, "tokenizer", None)
        self.chat = ChatContext(
            tools=getattr(environment, "tools", None),
            chat_template_kwargs=getattr(tokenizer_cfg, "chat_template_kwargs", None),
        )

    def request(self, active: list[int], turn: int) -> Any:
        """The generation request of ``active`` at ``turn``, with each sample's own seed (:func:`sampling_seed`)."""
        import torch

        batch = self.state.batch(active, self.pad)
        batch["sampling_seeds"] = torch.tensor(
            [
                sampling_seed(self.run_seed, self.step, self.samples[i // self.repeat].idx, i % self.repeat, turn)
                for i in active
            ],
            dtype=torch.long,
        )
        return batch

    def take(self, active: list[int], batch: Any, out: Any) -> None:
        """Append the engine's output for ``batch`` (cut to the sequence budget) to ``active``'s trajectories."""
        from rlcore.run.prompts import clip_rollout

        out = clip_rollout(out, batch["input_lengths"], self.max_total, self.pad)
        self.state.add_generated(active, batch["input_lengths"], out, self.tokenizer, self.max_total)

    def score(self, active: list[int], turn: int, timer: Timer) -> None:
        """Step the environment on ``active``'s logs (timed as ``environment``) and add what it answers."""
        state = self.state
        with timer.phase("environment"):
            result = self.environment.step([state.logs[i] for i in active], [state.metadata[i] for i in active])
        for i, error in zip(active, result.errors):
            if error:
                self.errors.append((turn, i, f"data row {self.samples[i // self.repeat].idx}: {error}", error))
        state.add_results(
            active, result, self.tokenizer, self.max_total, last_turn=turn == self.max_turns - 1, chat=self.chat
        )

    def sorted_errors(self) -> list[tuple[str, str]]:
        """``(named, error)`` per failed sample and turn, by turn then sample (the batch path's order)."""
        return [(named, error) for _, _, named, error in sorted(self.errors, key=lambda e: (e[0], e[1]))]


class Trajectories:
    """Per-sample token sequences, masks and logprobs growing turn by turn, with the message logs beside them."""

    def __init__(
        self,
        first: Any,
        metadata: list[dict[str, Any]],
        logs: list[list[dict[str, Any]]],
        cut_before: frozenset[int] = frozenset(),
    ) -> None:
        """``cut_before``: token ids a completion ends before, as if cut by its budget (a vision-language model's
        image placeholders: a forward would look for pixels for one the model wrote)."""
        import torch

        lengths = first["input_lengths"].tolist()
        self.prompt_lengths = first["input_lengths"].clone()
        cut = first.get("prompt_cut")
        self.prompt_cut = torch.zeros(len(lengths), dtype=torch.bool) if cut is None else cut.clone()
        self.tokens = [first["input_ids"][i, :length] for i, length in enumerate(lengths)]
        self.mask = [torch.zeros(length) for length in lengths]
        self.logprobs = [torch.zeros(length) for length in lengths]
        # the weight version of each token (-1: prompt, observation), kept when the engine reports it
        self.token_versions = [torch.full((length,), -1, dtype=torch.long) for length in lengths]
        self.has_token_versions = False
        # the generated tokens of turns whose tool calls the environment flagged, and each sample's latest turn
        self.invalid_calls = [torch.zeros(length, dtype=torch.bool) for length in lengths]
        self.latest: list[tuple[int, int]] = [(length, length) for length in lengths]
        # a vision-language run's rows: pixels, grids and images (docs/vision.md), sent with every turn's request
        self.image_rows = {key: first[key] for key in IMAGE_KEYS if key in first}
        self.cut_before = cut_before
        self.placeholder_cuts = 0  # completions cut before an image placeholder they generated
        self.metadata, self.logs = metadata, logs
        n = len(lengths)
        self.rewards = [0.0] * n
        self.components: dict[str, list[float]] = {}  # name -> each sample's sum over turns
        self.env_metrics: dict[str, list[float]] = {}  # the environment's metrics: name -> each sample's sum
        self.done = [False] * n
        self.stop_strings: list[Any] = [None] * n
        self.turns, self.env_tokens, self.first_turn = [0] * n, [0] * n, [0] * n
        self.truncated, self.terminated = [False] * n, [False] * n
        self.versions: list[int | None] = [None] * n
        self.windows: list[list[float] | None] = [None] * n

    def active(self) -> list[int]:
        return [i for i, done in enumerate(self.done) if not done]

    def batch(self, active: list[int], pad: int) -> Any:
        """The active samples' sequences so far, right-padded, with their stop strings."""
        import torch
        from torch.nn.utils.rnn import pad_sequence

        from rlcore.data import BatchedDataDict

        seqs = [self.tokens[i] for i in active]
        batch = BatchedDataDict(
            input_ids=pad_sequence(seqs, batch_first=True, padding_value=pad),
            input_lengths=torch.tensor([len(s) for s in seqs], dtype=torch.long),
        )
        if any(self.stop_strings[i] is not None for i in active):
            batch["stop_strings"] = [self.stop_strings[i] for i in active]
        for key, rows in self.image_rows.items():
            batch[key] = [rows[i] for i in active]
        return batch

    def add_generated(self, active: list[int], lengths: Any, out: Any, tokenizer: Any, max_total: int) -> None:
        """Append each active sample's completion: tokens, mask and logprobs, and its text to the message log."""
        import torch

        truncated = out.get("truncated")
        for row, i in enumerate(active):
            start, count = int(lengths[row]), int(out["generation_lengths"][row])
            new = out["output_ids"][row, start : start + count]
            if (cut := self._cut(new)) < count:  # the rest is not scored: the completion ends here
                new, count = new[:cut], cut
                self.truncated[i] = True
                self.placeholder_cuts += 1
            self.tokens[i] = torch.cat([self.tokens[i], new])
            self.mask[i] = torch.cat([self.mask[i], torch.ones(count)])
            self.logprobs[i] = torch.cat([self.logprobs[i], out["logprobs"][row, start : start + count].float()])
            self.token_versions[i] = torch.cat([self.token_versions[i], self._versions_of(out, row, start, count)])
            self.invalid_calls[i] = torch.cat([self.invalid_calls[i], torch.zeros(count, dtype=torch.bool)])
            self.latest[i] = (len(self.tokens[i]) - count, len(self.tokens[i]))
            if self.turns[i] == 0:
                self.first_turn[i] = count
            if (truncated is not None and bool(truncated[row])) or len(self.tokens[i]) >= max_total:
                self.truncated[i] = True
            if "weight_version" in out:
                version = int(out["weight_version"][row])
                self.versions[i] = version if self.versions[i] is None else min(self.versions[i], version)
                begin, end = (float(x) for x in out["generation_window"][row])
                old = self.windows[i]
                self.windows[i] = [begin, end] if old is None else [min(old[0], begin), max(old[1], end)]
            self.logs[i].append(
                {"role": "assistant", "content": tokenizer.decode(new.tolist(), skip_special_tokens=True)}
            )

    def _cut(self, new: Any) -> int:
        """Where a completion ends: before the first of its :attr:`cut_before` tokens, or at its end."""
        if self.cut_before:
            for k, token in enumerate(new.tolist()):
                if token in self.cut_before:
                    return k
        return len(new)

    def _versions_of(self, out: Any, row: int, start: int, count: int) -> Any:
        """The weight version of each of a completion's tokens: the engine's ``generation_weight_versions``, or
        -1 each from an engine that does not report them."""
        import torch

        if "generation_weight_versions" not in out:
            return torch.full((count,), -1, dtype=torch.long)
        self.has_token_versions = True
        return out["generation_weight_versions"][row, start : start + count].long()

    def add_results(
        self,
        active: list[int],
        result: Any,
        tokenizer: Any,
        max_total: int,
        last_turn: bool,
        chat: ChatContext | None = None,
    ) -> None:
        """Add the turn's rewards and invalid tool-call flags; end the samples that are done; append the others'
        observations (``chat``: the environment's tools and the chat template's kwargs)."""
        import torch

        from rlcore.chat.observations import observation_ids

        self.add_components(active, result.reward_components)
        self.add_sums(self.env_metrics, active, getattr(result, "metrics", None))
        flagged = getattr(result, "invalid_tool_calls", None) or [False] * len(active)
        for row, i in enumerate(active):
            if flagged[row]:
                start, end = self.latest[i]
                self.invalid_calls[i][start:end] = True
            self.rewards[i] += result.rewards[row]
            self.turns[i] += 1
            if result.terminateds[row]:
                self.done[i] = self.terminated[i] = True
                continue
            if last_turn or len(self.tokens[i]) >= max_total:  # out of turns, or of room
                self.done[i] = True
                continue
            start, end = self.latest[i]
            ids, logged = observation_ids(tokenizer, result.observations[row], self.tokens[i][start:end].tolist(), chat)
            obs = torch.tensor(ids, dtype=torch.long)
            if len(self.tokens[i]) + len(obs) >= max_total:  # no room to answer the observation
                self.done[i] = self.truncated[i] = True
                continue
            self.tokens[i] = torch.cat([self.tokens[i], obs])
            self.mask[i] = torch.cat([self.mask[i], torch.zeros(len(obs))])
            self.logprobs[i] = torch.cat([self.logprobs[i], torch.zeros(len(obs))])
            self.token_versions[i] = torch.cat([self.token_versions[i], torch.full((len(obs),), -1, dtype=torch.long)])
            self.invalid_calls[i] = torch.cat([self.invalid_calls[i], torch.zeros(len(obs), dtype=torch.bool)])
            self.env_tokens[i] += len(obs)
            self.logs[i].extend(logged)
            if result.metadata[row] is not None:
                self.metadata[i] = result.metadata[row]
            self.stop_strings[i] = result.next_stop_strings[row]

    def add_components(self, active: list[int], components: dict[str, list[float]] | None) -> None:
        """Add the turn's named rewards to the active samples' sums (a name new this turn starts at 0 for all)."""
        self.add_sums(self.components, active, components)

    def add_sums(self, sums: dict[str, list[float]], active: list[int], turn: dict[str, list[float]] | None) -> None:
        """Add the turn's named numbers to the active samples' ``sums`` (a name new this turn starts at 0 for all)."""
        for name, values in (turn or {}).items():
            totals = sums.setdefault(name, [0.0] * len(self.rewards))
            for row, i in enumerate(active):
                totals[i] += values[row]

    def padded(self, pad: int) -> Any:
        """The trajectories as one right-padded batch (see :class:`Rollout`)."""
        import torch
        from torch.nn.utils.rnn import pad_sequence

        data = padded_trajectories(
            TrajectoryTensors(
                self.tokens,
                self.mask,
                self.logprobs,
                self.invalid_calls,
                self.prompt_lengths,
                self.first_turn,
                self.truncated,
                self.prompt_cut,
            ),
            pad,
        )
        if self.versions[0] is not None:
            data["weight_version"] = torch.tensor(self.versions, dtype=torch.long)
            data["generation_window"] = torch.tensor(self.windows, dtype=torch.float64)
        if self.has_token_versions:  # per token, aligned with output_ids; -1 at prompt, observation and padding
            data["generation_weight_versions"] = pad_sequence(self.token_versions, batch_first=True, padding_value=-1)
        for name in sorted(self.components):
            data[f"reward/{name}"] = torch.tensor(self.components[name], dtype=torch.float32)
        for key in TRAINED_IMAGE_KEYS:
            if key in self.image_rows:
                data[key] = list(self.image_rows[key])
        return data

    def turn_metrics(self) -> dict[str, float]:
        """How the episodes went: turns, how they ended, the environment's share of the tokens."""
        n = len(self.turns)
        return {
            "rollout/turns_mean": sum(self.turns) / n,
            "rollout/natural_termination_rate": sum(self.terminated) / n,
            "rollout/truncation_rate": sum(self.truncated) / n,
            "rollout/env_tokens_mean": sum(self.env_tokens) / n,
        }
