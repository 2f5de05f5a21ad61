"""Kit check for the ``verified_refit`` capability: a corrupted refit is caught in one line naming the tensor.

A backend that declares ``verified_refit`` promises ``weight_fingerprints()``: after each refit, one
report per engine, ``{"weight_version": int, "fingerprints": {name: int}}``, computed with
:func:`rlcore.refit.fingerprint.fingerprint` over the weights the engine holds. The kit's own
engines are in-process fakes (no Ray): :class:`FakeEngines` loads what it is sent and reports
honestly; :class:`CorruptingEngines` changes one element of one tensor after load, as a broken
loader would. :func:`verified_refit_problems` runs the core's comparison against a backend and
returns what is wrong (empty when the promise holds).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from rlcore.refit.buckets import RefitError
from rlcore.refit.fingerprint import fingerprint, verify_engines

if TYPE_CHECKING:
    import torch


class FakeEngines:
    """``engines`` in-process generation engines that keep a copy of what a refit sends them."""

    def __init__(self, engines: int = 2) -> None:
        self.weights: list[dict[str, torch.Tensor]] = [{} for _ in range(engines)]
        self.version = 0

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        named = list(named_tensors)
        for held in self.weights:
            for name, tensor in named:
                held[name] = tensor.detach().clone()
        self.version = version

    def set_weight_version(self, version: int) -> None:
        self.version = version

    def weight_fingerprints(self) -> list[dict[str, Any]]:
        return [{"weight_version": self.version, "fingerprints": fingerprint(held.items())} for held in self.weights]


class CorruptingEngines(FakeEngines):
    """A faulty backend: engine ``engine`` holds tensor ``name`` with its last element changed after load."""

    def __init__(self, name: str, engines: int = 2, engine: int = 1) -> None:
        super().__init__(engines)
        self.corrupt_name, self.corrupt_engine = name, engine

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        super().load_weights(named_tensors, version)
        flat = self.weights[self.corrupt_engine][self.corrupt_name].view(-1)
        flat[-1] = flat[-1] + 1


def verified_refit_problems(engines: Any, named_tensors: list[tuple[str, torch.Tensor]], version: int = 1) -> list[str]:
    """Refit ``engines`` with ``named_tensors`` at ``version`` and verify; the verification error, if any."""
    sent = fingerprint(named_tensors)
    engines.load_weights(named_tensors, version)
    try:
        verify_engines(sent, engines.weight_fingerprints(), version=version)
    except RefitError as exc:
        return [str(exc)]
    return []


def report_problems(sent: Sequence[Mapping[str, int]], reports: list[dict[str, Any]], version: int) -> list[str]:
    """The core's comparison of each engine rank's report with what that rank was sent (``sent[rank]``: whole
    tensors, or a tensor-parallel rank's slices), as problem lines."""
    try:
        verify_engines(sent, reports, version=version)
    except RefitError as exc:
        return [str(exc)]
    return []


def unchanged_fingerprint_problems(sent: list[list[dict[str, int]]], reports: list[list[dict[str, Any]]]) -> list[str]:
    """Two refits of the same weights (``sent`` and ``reports``: one entry per refit, one item per engine rank):
    on each rank, a tensor sent alike both times must be reported alike both times."""
    problems = []
    for rank, (sent0, sent1, report0, report1) in enumerate(zip(*sent, *reports)):
        held0, held1 = report0["fingerprints"], report1["fingerprints"]
        alike = [name for name, value in sent0.items() if sent1.get(name) == value]
        changed = [name for name in alike if held0.get(name) != held1.get(name)]
        if changed:
            problems.append(
                f"engine rank {rank}: the fingerprints of {changed[:3]} changed between two refits of the same weights"
            )
    return problems
