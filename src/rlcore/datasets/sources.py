"""Where each step's samples come from: a dataset served in seeded epochs, or a generator function.

Batch ``k`` of a run is a pure function of ``k`` (and the seed): epoch ``k //
batches_per_epoch`` is a permutation of the dataset drawn from ``(seed,
epoch)``, and the batch is its ``k``-th slice (the last, partial slice of an
epoch is skipped, as a drop-last loader does). So a resumed run that knows
which batch comes next sees exactly the samples an uninterrupted run would,
and asynchronous GRPO can draw batches ahead of training. A step draws one
batch, or with dynamic sampling as many as it needs; the index of the next
batch is the data position a checkpoint records.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlcore.datasets.files import DataError, read_rows
from rlcore.datasets.samples import Sample, SampleBuilder


class DataExhausted(Exception):
    """The batches ``grpo.max_num_epochs`` allows are used up (a step of dynamic sampling asked for more)."""


class DatasetSource:
    """Fixed samples in batches of ``batch_size``, reshuffled every epoch when ``shuffle``."""

    def __init__(
        self,
        samples: Sequence[Sample],
        batch_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        max_epochs: int | None = None,
        name: str = "data.train",
        size_setting: str = "grpo.num_prompts_per_step",
        epochs_setting: str = "grpo.max_num_epochs",
    ) -> None:
        self.samples, self.batch_size, self.seed, self.shuffle = samples, batch_size, seed, shuffle
        self.max_epochs, self.epochs_setting = max_epochs, epochs_setting
        self.batches_per_epoch = len(samples) // batch_size
        if self.batches_per_epoch == 0:
            raise DataError(
                f"{name}: {len(samples)} samples, fewer than one batch's {batch_size} "
                f"({size_setting}): add samples or lower it"
            )
        self._orders: dict[int, list[int]] = {}

    @property
    def num_samples(self) -> int:
        return len(self.samples)

    @property
    def total_batches(self) -> int | None:
        """How many batches ``max_epochs`` allows (None: unbounded)."""
        return None if self.max_epochs is None else self.max_epochs * self.batches_per_epoch

    def epoch_of(self, k: int) -> int:
        return k // self.batches_per_epoch

    def batch(self, k: int) -> list[Sample]:
        if self.total_batches is not None and k >= self.total_batches:
            raise DataExhausted(
                f"{self.epochs_setting}={self.max_epochs}: the {self.total_batches} batches of "
                f"{self.batch_size} samples it allows are used up"
            )
        epoch, j = divmod(k, self.batches_per_epoch)
        order = self._order(epoch)
        return [self.samples[i] for i in order[j * self.batch_size : (j + 1) * self.batch_size]]

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(len(self.samples)))
            if self.shuffle:
                random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._orders = {epoch: order}  # one epoch at a time is all a run needs
        return self._orders[epoch]


class GeneratorSource:
    """Samples made up per batch by ``fn(k, n, seed, **kwargs)`` (prompts as strings, or rows as dicts)."""

    total_batches = None
    num_samples = None  # made up per batch: no fixed set

    def __init__(
        self,
        fn: Callable[..., list[Any]],
        kwargs: dict[str, Any],
        builder: SampleBuilder,
        batch_size: int,
        *,
        seed: int = 0,
        name: str = "data.train.generator",
    ) -> None:
        self.fn, self.kwargs, self.builder = fn, kwargs, builder
        self.batch_size, self.seed, self.name = batch_size, seed, name

    def epoch_of(self, k: int) -> int:
        return 0

    def batch(self, k: int) -> list[Sample]:
        items = list(self.fn(k, self.batch_size, seed=self.seed, **self.kwargs))
        if len(items) != self.batch_size:
            raise DataError(f"{self.name}: returned {len(items)} prompts for step {k}, asked for {self.batch_size}")
        key = self.builder.cfg.input_key
        return [
            self.builder.sample(
                item if isinstance(item, dict) else {key: item},
                k * self.batch_size + j,
                f"{self.name}: step {k} item {j + 1}",
            )
            for j, item in enumerate(items)
        ]


@dataclass
class RunData:
    """A run's samples: the training source and the validation samples (None: no validation); ``checked``: the
    samples checked before the run started, with the names their errors use."""

    train: DatasetSource | GeneratorSource
    validation: Sequence[Sample] | None
    checked: list[tuple[str, Sequence[Sample]]] = field(default_factory=list)

    def add_check(self, check: Callable[[Sample, str], None]) -> None:
        """Check the samples checked at the start again with ``check``, a rule known only once the run is built
        (the environment's tools in the prompt), and every row drawn from now on with it too."""
        for rows in (getattr(self.train, "samples", None), self.validation):
            if isinstance(rows, RowSamples):
                rows.check = _checks([c for c in (rows.check, check) if c is not None])
        for where, some in self.checked:
            for sample in some:
                check(sample, where)

    def num_steps(self, max_num_steps: int) -> int:
        """The steps a run trains: ``max_num_steps``, or fewer when the epochs of the train data end first (with
        dynamic sampling, an upper bound: a step may draw several batches)."""
        return min(max_num_steps, self.train.total_batches or max_num_steps)


@dataclass(frozen=True)
class DrawSettings:
    """How a run draws its samples, from its algorithm's section: batch size, seed, epochs, validation cap."""

    batch_size: int
    size_setting: str  # the setting(s) the batch size comes from, for errors
    seed: int
    max_epochs: int | None
    epochs_setting: str
    max_val_samples: int | None

    @classmethod
    def of(cls, cfg: Any) -> DrawSettings:
        """The settings the run's algorithm section declares (its ``draw_settings``)."""
        return cls(**cfg.algorithm_section.draw_settings(cfg.algorithm, cfg))


#: How many rows of a dataset are made into samples (and their prompts measured) before the run starts, spread
#: evenly over it; every other row is checked the same way when it is drawn. A set this size or smaller is
#: checked whole before the run, as before; a large one (OpenMathInstruct-2's millions of rows) starts at once.
ROWS_CHECKED_AT_START = 1000


class RowSamples(Sequence[Sample]):
    """The samples of a dataset's rows, each made (and checked) when it is read: the rows stay where they are (a
    memory-mapped ``datasets.Dataset``), never copied into a Python list. ``indices``: the rows this holds;
    ``base_dir``: what a relative image path of a row is relative to."""

    def __init__(
        self,
        rows: Sequence[dict[str, Any]],
        builder: SampleBuilder,
        where: str,
        indices: Sequence[int] | None = None,
        check: Callable[[Sample, str], None] | None = None,
        base_dir: Path | None = None,
    ) -> None:
        self.rows, self.builder, self.where, self.check, self.base_dir = rows, builder, where, check, base_dir
        self.indices = range(len(rows)) if indices is None else indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return RowSamples(self.rows, self.builder, self.where, self.indices[i], self.check, self.base_dir)
        j = self.indices[i]
        sample = self.builder.sample(dict(self.rows[j]), j, f"{self.where}: row {j + 1}", self.base_dir)
        if self.check is not None:
            self.check(sample, f"{self.where}: row")
        return sample

    def __iter__(self) -> Iterator[Sample]:
        return (self[i] for i in range(len(self)))

    def subset(self, positions: Sequence[int]) -> RowSamples:
        """The samples at ``positions`` (of this sequence), in that order."""
        indices = [self.indices[i] for i in positions]
        return RowSamples(self.rows, self.builder, self.where, indices, self.check, self.base_dir)

    def spread(self, n: int) -> RowSamples:
        """``n`` samples spread evenly over this (all of them when it holds ``n`` or fewer), made as they are read
        (:class:`RunData` keeps which rows it checked, not the samples)."""
        step = max(1, -(-len(self) // n))
        return self.subset(range(0, len(self), step))


def read_samples(dataset_cfg: Any, builder: SampleBuilder, key: str = "data.train") -> RowSamples:
    """The samples of one split (``key``: its setting), its rows rewritten by its ``format`` as they are drawn."""
    fmt = getattr(dataset_cfg, "format", None)
    if fmt == "oasst":  # a trees file: one tree, many conversations
        from rlcore.datasets.oasst import read_oasst_rows

        rows: Sequence[dict[str, Any]] = read_oasst_rows(dataset_cfg, f"{key}.hub_id")
    elif dataset_cfg.hub_id is not None:
        from rlcore.datasets.hub import read_hub_rows

        rows = read_hub_rows(dataset_cfg, f"{key}.hub_id")
    else:
        rows = read_rows(dataset_cfg.path, dataset_cfg.split)
    if fmt is not None and fmt != "oasst":
        from rlcore.datasets.formats import FormattedRows

        rows = FormattedRows(rows, fmt, dataset_cfg.source)
    return RowSamples(rows, builder, dataset_cfg.source, base_dir=_base_dir(dataset_cfg.path))


def _base_dir(path: str | None) -> Path | None:
    """What a row's relative image paths are relative to: a data file's directory, or a ``datasets`` directory
    itself (None for a hub dataset: the working directory)."""
    if path is None:
        return None
    where = Path(path).expanduser()
    return where if where.is_dir() else where.parent


def split_off(samples: RowSamples, fraction: float, seed: int) -> tuple[RowSamples, RowSamples]:
    """``(rest, held_out)``: a seeded draw of ``fraction`` of the samples (at least one), in file order."""
    n = max(1, round(len(samples) * fraction))
    held = set(random.Random(seed).sample(range(len(samples)), n))
    rest = [i for i in range(len(samples)) if i not in held]
    return samples.subset(rest), samples.subset(sorted(held))


def load_sources(cfg: Any, prompt_length: Callable[[Sample], int] | None = None, images: bool = False) -> RunData:
    """The run's samples from ``cfg.data`` (read and checked now: raises :class:`DataError`).

    ``prompt_length`` (the prompt's tokens under the run's chat template): every sample must leave room for a
    completion within ``policy.max_total_sequence_length``, unless ``data.max_input_seq_length`` is set: a prompt
    that long is cut and masked out of the loss, and every shorter one leaves room (the limit is at most
    ``policy.max_total_sequence_length``: a config rule, ``rlcore.config.rules``). ``images``: whether the
    caller trains on a sample's images; if not, a sample that has some is refused rather than trained as text.
    """
    from rlcore.plugins import import_object

    data, draw = cfg.data, DrawSettings.of(cfg)
    builder = SampleBuilder(data)
    length = None
    if prompt_length is not None and data.max_input_seq_length is None:
        length = length_check(prompt_length, cfg.policy.max_total_sequence_length)
    check = _checks([c for c in (length, None if images else _no_images) if c is not None]) or _made
    held_out: RowSamples | None = None
    if data.train.generator is not None:
        try:
            fn = import_object(data.train.generator)
        except (ImportError, AttributeError, ValueError) as exc:
            raise DataError(f"data.train.generator: cannot import {data.train.generator}: {exc}") from None
        train: DatasetSource | GeneratorSource = GeneratorSource(
            fn, data.train.generator_kwargs, builder, draw.batch_size, seed=draw.seed
        )
        # made up per step: the first step's prompts stand for the others (a multi-turn game's, say)
        checked: list[tuple[str, Sequence[Sample]]] = [
            (f"{train.name} ({data.train.generator}): step 0 item", train.batch(0))
        ]
    else:
        samples = read_samples(data.train, builder)
        if data.split_validation_size:
            samples, held_out = split_off(samples, data.split_validation_size, draw.seed)
        train = DatasetSource(
            samples,
            draw.batch_size,
            seed=draw.seed,
            shuffle=data.shuffle,
            max_epochs=draw.max_epochs,
            name=f"data.train ({data.train.source})",
            size_setting=draw.size_setting,
            epochs_setting=draw.epochs_setting,
        )
        checked = [(f"{data.train.source}: row", samples.spread(ROWS_CHECKED_AT_START))]
    validation = None
    if data.validation is not None:
        validation = read_samples(data.validation, builder, "data.validation")[: draw.max_val_samples]
        checked.append((f"{data.validation.source}: row", validation.spread(ROWS_CHECKED_AT_START)))
    elif held_out is not None:
        validation = held_out[: draw.max_val_samples]
        checked.append((f"{data.train.source}: row", validation.spread(ROWS_CHECKED_AT_START)))
    if prompt_length is not None and data.max_input_seq_length is not None:
        _some_prompt_under(prompt_length, data.max_input_seq_length, checked)
    run_data = RunData(train, validation, checked)
    run_data.add_check(check)  # the checked rows now, the others as they are drawn
    return run_data


def _some_prompt_under(
    prompt_length: Callable[[Sample], int], limit: int, checked: list[tuple[str, Sequence[Sample]]]
) -> None:
    """With ``data.max_input_seq_length`` a prompt at the limit is cut and masked out of the loss; a split whose
    checked rows are all that long would train (or validate) nothing, which is a mistake, not a run."""
    for where, some in checked:
        lengths = [prompt_length(sample) for sample in some]
        if lengths and min(lengths) >= limit:
            raise DataError(
                f"{where.rpartition(':')[0]}: every prompt checked ({len(lengths)} rows, the shortest "
                f"{min(lengths)} tokens) is at least data.max_input_seq_length={limit} tokens, so each would be "
                "cut and masked out of the loss and nothing trained: raise data.max_input_seq_length (and "
                "policy.max_total_sequence_length), or shorten the prompts"
            )


def _made(sample: Sample, where: str) -> None:
    """No rule beyond making the sample: a row that cannot be made has raised already."""


def _no_images(sample: Sample, where: str) -> None:
    if sample.images:
        raise DataError(
            f"{where} {sample.idx + 1}: the sample has {len(sample.images)} image(s) (data.image_key, or image parts "
            "in its messages), and this run trains on text only: its algorithm or its model (policy.model_name) "
            "takes no images; train a vision-language model with GRPO (docs/vision.md), or remove the images"
        )


def _checks(checks: list[Callable[[Sample, str], None]]) -> Callable[[Sample, str], None] | None:
    """One check running ``checks`` in order; None for none."""
    if len(checks) < 2:
        return checks[0] if checks else None

    def check(sample: Sample, where: str) -> None:
        for one in checks:
            one(sample, where)

    return check


def length_check(prompt_length: Callable[[Sample], int], limit: int) -> Callable[[Sample, str], None]:
    def check(sample: Sample, where: str) -> None:
        if (n := prompt_length(sample)) >= limit:
            raise DataError(
                f"{where} {sample.idx + 1}: the prompt is {n} tokens, which leaves no room "
                f"for a completion within policy.max_total_sequence_length={limit}: shorten "
                f"or drop the {where.rpartition(' ')[2]}, or raise the limit"
            )

    return check
