"""The worker contract: the methods the core calls on a backend's Ray workers, as ``Protocol`` s.

Each Protocol method is written the way the core calls it: positional
parameters are passed by position, keyword-only ones by name. ``Policy`` calls
its workers through these methods (``self._all(TrainingWorker.is_alive)``), so
the calls and the contract cannot drift apart, and :func:`worker_problems`
checks a worker class against them before any process starts (the
conformance kit runs it). Which Protocols apply follows from the capabilities
a spec declares (:data:`CAPABILITY_PROTOCOLS`); a worker is constructed with
the keyword arguments its ``__init__`` declares (:mod:`rlcore.plugins.negotiation`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from types import FunctionType
from typing import TYPE_CHECKING, Literal, Protocol, TypedDict

from rlcore.plugins import CAPABILITY_METHODS, TRAINING_WORKER_KEYWORDS, BackendSpec, Capability

if TYPE_CHECKING:
    import torch

    from rlcore.data import BatchedDataDict
    from rlcore.interfaces.loss import LossFunction
    from rlcore.interfaces.specs import (
        GenerationDatumSpec,
        GenerationOutputSpec,
        LogprobOutputSpec,
        ReferenceLogprobOutputSpec,
        RefitInfo,
        TopkLogitsOutputSpec,
        TrainingBatch,
    )

#: How ``Policy`` cut the data into micro-batches (see ``rlcore.config.BatchPlan``).
Mode = Literal["plain", "dynamic", "packing"]


class ValueOutputSpec(TypedDict):
    """What ``get_values`` returns (capability ``value_head``)."""

    values: torch.Tensor  # [B, S] float32, aligned like logprobs: position 0 and padding 0


class TrainingWorker(Protocol):
    """What ``Policy`` calls on every rank of any training backend."""

    def is_alive(self) -> bool: ...

    def get_logprobs(
        self, data: BatchedDataDict[GenerationDatumSpec], /, *, mode: Mode
    ) -> BatchedDataDict[LogprobOutputSpec]: ...

    def get_reference_policy_logprobs(
        self, data: BatchedDataDict[GenerationDatumSpec], /, *, micro_batch_size: int | None, mode: Mode
    ) -> BatchedDataDict[ReferenceLogprobOutputSpec]: ...

    def train(
        self,
        data: BatchedDataDict[TrainingBatch],
        /,
        *,
        loss_fn: LossFunction,
        eval_mode: bool,
        gbs: int,
        mbs: int,
        mode: Mode,
    ) -> dict[str, object]: ...

    def prepare_for_training(self) -> None: ...

    def prepare_for_lp_inference(self) -> None: ...

    def finish_training(self) -> None: ...

    def offload_before_refit(self) -> None: ...

    def offload_after_refit(self) -> None: ...

    def save_checkpoint(self, weights_path: str, optimizer_path: str | None, tokenizer_path: str | None, /) -> None: ...

    def load_checkpoint(self, weights_path: str, optimizer_path: str | None, /) -> None: ...

    def start_gpu_profiling(self) -> None: ...

    def stop_gpu_profiling(self) -> None: ...

    def shutdown(self) -> None: ...


class TopkLogitsWorker(Protocol):
    """Capability ``topk_logits``."""

    def get_topk_logits(
        self, data: BatchedDataDict[GenerationDatumSpec], /, *, k: int, micro_batch_size: int | None, mode: Mode
    ) -> BatchedDataDict[TopkLogitsOutputSpec]: ...


class RefitWorker(Protocol):
    """Capability ``refit``: the sending side of a weight refit (``rlcore.refit.RefitExportMixin`` has it)."""

    def prepare_refit_info(self) -> RefitInfo | None: ...

    def stream_weights_via_ipc_zmq(self, *, endpoints: dict[int, tuple[str, bytes]], bucket_bytes: int) -> int: ...

    def init_collective(self, ip: str, port: int, world_size: int, /, *, train_world_size: int) -> None: ...

    def broadcast_weights_for_collective(self, *, kv_scales: dict[str, float] | None, bucket_bytes: int) -> int: ...


class LoraWorker(Protocol):
    """Capability ``lora``: refits after the first send only the adapted layers; adapters save on their own."""

    def prepare_refit_info(self, *, changed_only: bool) -> RefitInfo | None: ...

    def stream_weights_via_ipc_zmq(
        self, *, endpoints: dict[int, tuple[str, bytes]], bucket_bytes: int, changed_only: bool
    ) -> int: ...

    def broadcast_weights_for_collective(
        self, *, kv_scales: dict[str, float] | None, bucket_bytes: int, changed_only: bool
    ) -> int: ...

    def save_lora_adapter(self, path: str, /) -> None: ...


class GeneratingWorker(Protocol):
    """Capability ``generate`` of a training backend: it generates with its own weights."""

    def generate(
        self, data: BatchedDataDict[GenerationDatumSpec], /, *, greedy: bool
    ) -> BatchedDataDict[GenerationOutputSpec]: ...


class ValueWorker(Protocol):
    """Capability ``value_head``: a worker built with ``model_head="value"`` is a value model.

    ``values`` is ``[B, S]`` float32 aligned like logprobs: position ``i`` holds V(s_i), the value of the state in
    which token ``i`` is chosen (the head's output at the hidden state of position ``i - 1``); position 0 and
    padding are 0. ``mode`` is how ``Policy`` cut the data, as for ``get_logprobs``.
    """

    def get_values(
        self, data: BatchedDataDict[GenerationDatumSpec], /, *, micro_batch_size: int | None, mode: Mode
    ) -> BatchedDataDict[ValueOutputSpec]: ...


class GenerationWorker(Protocol):
    """What every generation backend's worker has (its driver class, a ``GenerationInterface``, calls it)."""

    def generate(
        self, data: BatchedDataDict[GenerationDatumSpec], /, *, greedy: bool
    ) -> BatchedDataDict[GenerationOutputSpec]: ...

    def prepare_for_generation(self) -> bool: ...

    def finish_generation(self) -> bool: ...

    def shutdown(self) -> object: ...


#: The Protocols a declared capability adds to a training worker's contract.
CAPABILITY_PROTOCOLS: dict[Capability, type] = {
    Capability.TOPK_LOGITS: TopkLogitsWorker,
    Capability.REFIT: RefitWorker,
    Capability.LORA: LoraWorker,
    Capability.GENERATE: GeneratingWorker,
    Capability.VALUE_HEAD: ValueWorker,
}


def required_protocols(spec: BackendSpec) -> list[type]:
    """The Protocols a worker of ``spec`` must satisfy."""
    if spec.kind == "generation":
        return [GenerationWorker]
    return [TrainingWorker, *(p for c, p in CAPABILITY_PROTOCOLS.items() if spec.supports(c))]


def protocol_methods(protocol: type) -> dict[str, FunctionType]:
    """``{name: function}`` of the methods a Protocol declares."""
    return {name: fn for name, fn in vars(protocol).items() if inspect.isfunction(fn) and not name.startswith("_")}


def _call_problem(  # type: ignore[explicit-any]  # impl: a method of any signature, which is what is checked
    owner: str, name: str, impl: Callable[..., object], args: list[str], kwargs: list[str]
) -> str | None:
    """Why ``impl`` cannot take the call ``name(*args, **kwargs)`` (None when it can)."""
    shown = ", ".join([*args, *(f"{k}=..." for k in kwargs)])
    try:
        signature = inspect.signature(impl)
    except (TypeError, ValueError):
        return None  # a builtin or C callable: nothing to read, the call is the check
    try:
        signature.bind(object(), *args, **{k: None for k in kwargs})
    except TypeError as exc:
        return f"{owner}.{name}{signature} cannot take rlcore's call {name}({shown}): {exc}"
    return None


def _protocol_call(fn: FunctionType) -> tuple[list[str], list[str]]:
    """The positional and keyword argument names of a Protocol method (its call shape)."""
    params = list(inspect.signature(fn).parameters.values())[1:]
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    keywords = [p.name for p in params if p.kind == p.KEYWORD_ONLY]
    return positional, keywords


def worker_problems(worker_cls: type, spec: BackendSpec) -> list[str]:
    """Why ``worker_cls`` breaks the contract of ``spec``: a missing method, a signature that cannot take
    the core's call, or a constructor the core cannot call. Empty when fine."""
    owner = worker_cls.__qualname__
    problems = capability_problems(worker_cls, spec.capabilities) if spec.kind == "training" else []
    for protocol in required_protocols(spec):
        for name, fn in protocol_methods(protocol).items():
            impl = getattr(worker_cls, name, None)
            if not callable(impl):
                if protocol is TrainingWorker or protocol is GenerationWorker:
                    problems.append(f"{owner}.{name}: missing ({protocol.__name__} of rlcore.interfaces.workers)")
            elif problem := _call_problem(owner, name, impl, *_protocol_call(fn)):
                problems.append(problem)
    return problems + constructor_problems(worker_cls, spec)


def capability_problems(worker_cls: type, capabilities: Iterable[Capability | str]) -> list[str]:
    """One line per declared capability whose methods ``worker_cls`` lacks, naming the capability, the
    methods and the fix (the worker host refuses to build such a worker; the kit refuses it too)."""
    owner = f"{worker_cls.__module__}:{worker_cls.__qualname__}"
    problems = []
    for capability in sorted(Capability(c) for c in capabilities):
        missing = [m for m in CAPABILITY_METHODS.get(capability, ()) if not callable(getattr(worker_cls, m, None))]
        if missing:
            problems.append(
                f"declares capability '{capability}', but {owner} has no {', '.join(missing)} "
                f"({CAPABILITY_PROTOCOLS[capability].__name__} of rlcore.interfaces.workers): implement "
                f"{'it' if len(missing) == 1 else 'them'} or drop '{capability}' from its capabilities"
            )
    return problems


def constructor_problems(worker_cls: type, spec: BackendSpec) -> list[str]:
    """Whether a training worker's ``__init__`` takes ``(config, tokenizer)`` positionally, and every keyword it
    requires is one the core offers (it is given only those it declares)."""
    if spec.kind != "training":
        return []
    owner = worker_cls.__qualname__
    try:
        signature = inspect.signature(worker_cls.__init__)  # type: ignore[misc]  # the class's own, with self
    except (TypeError, ValueError):
        return []
    params = list(signature.parameters.values())[1:]
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    takes_varargs = any(p.kind is p.VAR_POSITIONAL for p in params)
    if len(positional) < 2 and not takes_varargs:
        return [
            f"{owner}.__init__{signature} cannot take rlcore's call __init__(config, tokenizer, ...): it "
            "must take the policy config and the tokenizer positionally"
        ]
    rest = [p for p in params if p not in positional[:2]]
    unknown = [
        p.name
        for p in rest
        if p.default is p.empty
        and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        and p.name not in TRAINING_WORKER_KEYWORDS
    ]
    if unknown:
        return [
            f"{owner}.__init__ requires {', '.join(unknown)}, which rlcore does not pass (it offers "
            f"{', '.join(TRAINING_WORKER_KEYWORDS)}): give {'it' if len(unknown) == 1 else 'them'} a default or "
            "take one of those"
        ]
    return []
