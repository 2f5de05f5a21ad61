"""The environment contract: what scores a rollout (and, over several turns, answers it).

An environment is a class named in an ``EnvironmentSpec`` (or, the older way, a
``BackendSpec`` of kind ``environment``). The core builds it as ``Environment(config)``, where
``config`` is the validated ``env.<name>_cfg`` section (an instance of the
spec's ``config_class``; ``None`` without one), and calls :meth:`step` with a
batch of message logs and each sample's metadata: the dataset row's columns,
with the expected answer under ``"ground_truth"``. The shape follows NeMo-RL's
``EnvironmentInterface``, so an environment written for it ports by renaming.

One sample's failure must not end the run: a sample the environment cannot
score gets reward 0 and a line in ``errors``; the core counts them
(``env/errors``). An environment that raises is called again one sample at a
time, so only the samples that raise are lost.

An environment that scores several things (correctness, format, ...) may
also return them by name in ``reward_components`` (plugin API 5), for GDPO
(``grpo.advantage_estimator: gdpo``), which normalizes each one within its
group before combining them; NeMo-RL's multi-reward environments return the
same as a ``rewards`` dict.

Tool-using environments (issue 55): a message is any JSON-like dict (a ``tool`` message carries
``tool_call_id`` and ``name``, an assistant message may carry ``tool_calls``). An environment may flag the
samples whose latest assistant turn held a malformed or invalid tool call (``invalid_tool_calls``): the rollout
marks that turn's generated tokens (``invalid_tool_call_mask``), which ``grpo.invalid_tool_call_advantage``
reads. It may also report numbers about each sample's turn by name (``metrics``), which the rollout sums per
sample over its turns and logs (:func:`environment_metrics`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

#: One chat message: ``{"role": "system" | "user" | "assistant" | "environment" | "tool", "content": str, ...}``;
#: a ``tool`` message also carries ``tool_call_id`` and ``name``, an assistant message may carry ``tool_calls``.
Message = dict[str, Any]


@dataclass
class EnvironmentReturn:
    """What :meth:`EnvironmentInterface.step` returns: one entry per sample in every list.

    ``observations``: the message the environment appends to each log (multi-turn; ``{"role":
    "environment", "content": ""}`` when it has nothing to say). ``metadata``: each sample's metadata for its
    next turn (``None`` once done). ``next_stop_strings``: stop strings for the next turn's generation, or
    ``None``. ``rewards``: the reward of each sample's latest turn. ``terminateds``: whether each sample is
    done. ``answers``: the answer the environment read from each completion, for logs (or ``None``).
    ``errors``: why a sample could not be scored (it gets reward 0), or ``None``.

    ``reward_components`` (optional, plugin API 5): named rewards of the latest turn, ``{name: [one float per
    sample]}``, the same names for every sample (kept sorted by name); ``rewards`` stays the total the run
    reports and GRPO trains on, by NeMo-RL's convention their sum (:meth:`from_components`). A sample that could
    not be scored has no components: a result built by joining parts (:meth:`concat`) gives each component 0 on
    the samples of a part without them, which must be failed samples (each with an error).

    ``invalid_tool_calls`` (optional): whether each sample's latest assistant turn held a malformed or invalid
    tool call (default: all False). ``metrics`` (optional): numbers about each sample's latest turn by name,
    ``{name: [one float per sample]}`` (a tools environment: ``tool_calls``, ``invalid_tool_calls``); joined
    parts without a name count 0 for it.
    """

    observations: list[Message]
    metadata: list[dict[str, Any] | None]
    rewards: list[float]
    terminateds: list[bool]
    next_stop_strings: list[list[str] | None] = field(default_factory=list)
    answers: list[str | None] = field(default_factory=list)
    errors: list[str | None] = field(default_factory=list)
    reward_components: dict[str, list[float]] | None = None
    invalid_tool_calls: list[bool] = field(default_factory=list)
    metrics: dict[str, list[float]] | None = None

    def __post_init__(self) -> None:
        n = len(self.rewards)
        self.rewards = [float(r) for r in self.rewards]
        self.terminateds = [bool(t) for t in self.terminateds]
        for name in ("next_stop_strings", "answers", "errors"):
            if not getattr(self, name):
                setattr(self, name, [None] * n)
        self.invalid_tool_calls = [bool(f) for f in self.invalid_tool_calls] or [False] * n
        lengths = {
            name: len(getattr(self, name))
            for name in (
                "observations",
                "metadata",
                "rewards",
                "terminateds",
                "next_stop_strings",
                "answers",
                "errors",
                "invalid_tool_calls",
            )
        }
        if set(lengths.values()) != {n}:
            raise ValueError(f"EnvironmentReturn: every list needs one entry per sample, got lengths {lengths}")
        if self.reward_components is not None:
            self.reward_components = _checked_components(self.reward_components, n)
        if self.metrics is not None:
            self.metrics = _checked_metrics(self.metrics, n)

    @classmethod
    def final(
        cls,
        rewards: list[float],
        metadata: list[dict[str, Any]],
        answers: list[str | None] | None = None,
        errors: list[str | None] | None = None,
        reward_components: dict[str, list[float]] | None = None,
    ) -> EnvironmentReturn:
        """A single-turn result: every sample scored and done, no observation."""
        n = len(rewards)
        return cls(
            [{"role": "environment", "content": ""} for _ in range(n)],
            list(metadata),
            list(rewards),
            [True] * n,
            answers=list(answers or []),
            errors=list(errors or []),
            reward_components=reward_components,
        )

    @classmethod
    def from_components(
        cls,
        reward_components: dict[str, list[float]],
        metadata: list[dict[str, Any]],
        answers: list[str | None] | None = None,
        errors: list[str | None] | None = None,
    ) -> EnvironmentReturn:
        """A single-turn result scored by named rewards; each sample's reward is their sum (NeMo-RL's
        ``total_reward``)."""
        components = _checked_components(reward_components, len(metadata))
        rewards = [sum(values) for values in zip(*components.values())]
        return cls.final(rewards, metadata, answers, errors, reward_components=components)

    @classmethod
    def concat(cls, parts: list[EnvironmentReturn]) -> EnvironmentReturn:
        """The results of consecutive chunks of one batch, as one."""
        joined = cls(
            observations=[item for part in parts for item in part.observations],
            metadata=[item for part in parts for item in part.metadata],
            rewards=[item for part in parts for item in part.rewards],
            terminateds=[item for part in parts for item in part.terminateds],
            next_stop_strings=[item for part in parts for item in part.next_stop_strings],
            answers=[item for part in parts for item in part.answers],
            errors=[item for part in parts for item in part.errors],
            invalid_tool_calls=[item for part in parts for item in part.invalid_tool_calls],
        )
        joined.reward_components = _joined_components(parts)
        joined.metrics = _joined_metrics(parts)
        return joined


def _checked_components(components: object, n: int) -> dict[str, list[float]]:
    """``components`` as ``{name: [n floats]}`` sorted by name, or a ``ValueError`` saying what is wrong."""
    if isinstance(components, dict) and not components:
        raise ValueError("EnvironmentReturn.reward_components: is empty; name at least one component, or leave it None")
    return _checked_per_sample(
        "reward_components",
        components,
        n,
        f"got {type(components).__name__}",
        "component name (a non-empty string without '/': rlcore logs it as reward/<name>_mean; NeMo-RL's "
        "'reward/' prefix is not part of the name)",
    )


def _checked_per_sample(field: str, values: object, n: int, got: str, what_a_name_is: str) -> dict[str, list[float]]:
    """``EnvironmentReturn.<field>`` as ``{name: [n floats]}`` sorted by name, or a ``ValueError`` naming the field:
    ``got`` says what was given instead of a dict, ``what_a_name_is`` what a valid name is."""
    if not isinstance(values, dict):
        raise ValueError(f"EnvironmentReturn.{field}: expected a dict of name -> one float per sample, {got}")
    checked = {}
    for name in sorted(values, key=str):
        if not isinstance(name, str) or not name or "/" in name:
            raise ValueError(f"EnvironmentReturn.{field}: {name!r} is not a {what_a_name_is}")
        per_sample = list(values[name])
        if len(per_sample) != n:
            raise ValueError(
                f"EnvironmentReturn.{field}['{name}']: needs one entry per sample, got {len(per_sample)} for {n} "
                "samples"
            )
        checked[name] = [float(v) for v in per_sample]
    return checked


def _joined_components(parts: list[EnvironmentReturn]) -> dict[str, list[float]] | None:
    """The parts' components end to end; a part without them (all its samples failed) counts 0 for each."""
    names = [list(p.reward_components) for p in parts if p.reward_components is not None]
    if not names:
        return None
    if any(other != names[0] for other in names):
        raise ValueError(
            f"EnvironmentReturn.reward_components: the samples of one batch have different component "
            f"names: {sorted({tuple(n) for n in names})}"
        )
    joined: dict[str, list[float]] = {name: [] for name in names[0]}
    for part in parts:
        if part.reward_components is None and not all(part.errors):
            raise ValueError(
                "EnvironmentReturn.reward_components: some samples of the batch have reward "
                "components and others, scored without an error, have none"
            )
        for name, values in joined.items():
            values.extend(
                part.reward_components[name] if part.reward_components is not None else [0.0] * len(part.rewards)
            )
    return joined


def _checked_metrics(metrics: object, n: int) -> dict[str, list[float]]:
    """``metrics`` as ``{name: [n floats]}`` sorted by name, or a ``ValueError`` saying what is wrong."""
    return _checked_per_sample(
        "metrics",
        metrics,
        n,
        f"got {metrics!r}",
        "metric name (a non-empty string without '/': rlcore logs it as env/<name>_per_sample)",
    )


def _joined_metrics(parts: list[EnvironmentReturn]) -> dict[str, list[float]] | None:
    """The parts' metrics end to end; a part without a name (a failed chunk, say) counts 0 for it."""
    names = sorted({name for p in parts for name in (p.metrics or {})})
    if not names:
        return None
    return {name: [v for p in parts for v in (p.metrics or {}).get(name, [0.0] * len(p.rewards))] for name in names}


def environment_metrics(totals: dict[str, list[float]]) -> dict[str, float]:
    """A rollout's ``env/`` metrics from each sample's ``metrics`` summed over its turns (``{name: [B]}``):
    ``env/<name>_per_sample``, the mean over the samples; and for a pair ``<x>`` and ``invalid_<x>`` (a tools
    environment's ``tool_calls`` and ``invalid_tool_calls``), ``env/valid_<x>_rate``: the share of all of them
    that were valid (left out when there were none)."""
    metrics = {f"env/{name}_per_sample": sum(values) / max(len(values), 1) for name, values in totals.items()}
    for name, values in totals.items():
        invalid = totals.get(f"invalid_{name}")
        if invalid is not None and sum(values) > 0:
            metrics[f"env/valid_{name}_rate"] = 1.0 - sum(invalid) / sum(values)
    return metrics


@runtime_checkable
class EnvironmentInterface(Protocol):
    """Scores a batch of rollouts. ``close`` (optional) releases what the environment holds."""

    def step(self, message_logs: list[list[Message]], metadata: list[dict[str, Any]]) -> EnvironmentReturn:
        """Score the latest assistant message of each log, against its sample's ``metadata``."""
        ...


__all__ = ["EnvironmentInterface", "EnvironmentReturn", "Message", "environment_metrics"]
