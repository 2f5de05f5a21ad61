"""Run megatron-core 0.16.1 on a machine without a GPU (CPU tensors, gloo collectives).

megatron-core is written for CUDA: it allocates buffers with
``device=torch.cuda.current_device()`` or ``device="cuda"``, seeds and forks
CUDA RNG states, calls ``torch.cuda.synchronize()`` around communication and
moves one tensor with ``Tensor.cuda()``. The maths itself is device-agnostic
and runs unchanged on CPU (design.md §5). This module redirects exactly those
call sites, and nothing else:

- **Module-local ``torch``.** In each module of :data:`REDIRECTED_MODULES` (the
  modules of the listed call sites) the global name ``torch`` is replaced by
  :class:`_CpuTorch`, a view of the real ``torch`` module that differs in two
  ways only: tensor factories
  (:data:`_FACTORIES`) given a CUDA device allocate on CPU, and ``torch.cuda``
  is :class:`_CpuCuda` (``current_device()`` is the CPU device,
  ``synchronize()`` / ``empty_cache()`` do nothing since CPU work is
  synchronous, and the RNG functions act on the CPU generator). Code outside
  these modules — torch itself, transformers, rlcore — sees the real torch.
- **CUDA RNG state helpers.** ``tensor_parallel.random._get_cuda_rng_state`` /
  ``_set_cuda_rng_state`` (used by the RNG tracker's ``fork`` and by
  activation checkpointing to replay dropout) get and set the CPU generator's
  state. Megatron's tracker thus keeps its meaning: the model-parallel RNG
  stream is forked from, and restored to, the default stream.
- **Gradient clipping.** ``clip_grad_by_total_norm_fp32`` asserts each gradient
  is a ``'torch.cuda.FloatTensor'``; the optimizer module uses
  :func:`_clip_grad_by_total_norm_fp32` instead, the same scaling with the
  assert on the dtype (float32) rather than on the device.
- **CUDA tensor type names.** The mixed-precision (bf16/fp16) and distributed
  optimizers sort the parameters they wrap by ``param.type()`` against
  ``'torch.cuda.BFloat16Tensor'`` / ``'torch.cuda.FloatTensor'`` names (bf16
  ones get fp32 main copies, fp32 ones are stepped as they are) and raise for
  anything else. During their constructors only, ``Tensor.type()`` (no
  argument, CPU tensor) names the CUDA type of the same dtype, so CPU
  parameters are sorted by their dtype exactly as CUDA ones are.
- **Tied embeddings with pipeline parallelism.**
  ``LanguageModule.setup_embeddings_and_output_layer`` moves the last stage's
  copy of the word embeddings with ``weight.data.cuda()`` before all-reducing
  it with the first stage; on CPU it runs with ``Tensor.cuda`` as the identity
  for the duration of that one call.

:data:`CALL_SITES` lists every function whose CUDA use is redirected and the
token it contains. Each redirect records the megatron function it served
(:func:`observed_call_sites`); the tests check that every listed function
still contains its token in the installed megatron-core (an upgrade that moves
a call site is noticed), that each redirect behaves, and that TP=2 / PP=2
training runs redirect nothing that is not listed
(``tests/test_megatron_cpu_compat.py``, ``tests/test_megatron_parallel.py``).

Features that need CUDA for more than these call sites are not emulated but
rejected by the worker's config checks (:mod:`rl_megatron.config`): packed
sequences (TransformerEngine). Context parallelism selects its rotary positions itself
(:mod:`rl_megatron.context_parallel`), without megatron's ``.cuda()`` call.

:func:`apply` is called by the worker, in its own process, only when CUDA is
not available; importing this module changes nothing. On a GPU none of this
is active.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
import threading
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class CallSite:
    """One function of megatron-core that uses CUDA, and how the CPU run gets past it."""

    module: str
    function: str  # qualified name inside ``module``
    token: str  # the CUDA use, as it appears in the source
    redirect: str  # which mechanism handles it


_T = "module-local torch"
_RNG = "CPU RNG state helpers"
_R = "megatron.core.tensor_parallel.random"
_P2P = "megatron.core.pipeline_parallel.p2p_communication"
_TD = "megatron.core.transformer.moe.token_dispatcher"
_OPT = "megatron.core.optimizer.optimizer"
_DOPT = "megatron.core.optimizer.distrib_optimizer"
_TYPES = "CUDA tensor type names"
#: Every CUDA use met on the code paths the backend runs: model build, forward/backward with
#: TP and PP (tied embeddings included), activation checkpointing, DDP, the FP32 optimizer,
#: gradient clipping, RNG seeding, distributed checkpoint save/load. ``tests/test_megatron_cpu_compat.py``
#: checks that each token is in its function, and that a run redirects nothing unlisted.
CALL_SITES: tuple[CallSite, ...] = (
    # RNG tracker seeding and forking (dropout streams), activation-checkpoint RNG replay.
    CallSite(_R, "model_parallel_cuda_manual_seed", "torch.cuda.manual_seed(", _T),
    CallSite(_R, "CudaRNGStatesTracker.add", "torch.cuda.get_rng_state()", _T),
    CallSite(_R, "CudaRNGStatesTracker.fork", "_get_cuda_rng_state(", _RNG),
    CallSite(_R, "_get_all_rng_states", "_get_cuda_rng_state(", _RNG),
    CallSite(_R, "_set_all_rng_states", "_set_cuda_rng_state(", _RNG),
    # Buffers allocated on "the current CUDA device".
    CallSite("megatron.core.utils", "GlobalMemoryBuffer.get_tensor", "torch.cuda.current_device()", _T),
    CallSite(
        "megatron.core.models.common.embeddings.rotary_pos_embedding",
        "RotaryEmbedding.get_emb",
        "torch.cuda.current_device()",
        _T,
    ),
    CallSite(
        "megatron.core.distributed.param_and_grad_buffer",
        "_ParamAndGradBuffer.__init__",
        "torch.cuda.current_device()",
        _T,
    ),
    CallSite(_OPT, "FP32Optimizer.__init__", "device='cuda'", _T),
    # Pipeline schedules and their point-to-point communication.
    CallSite("megatron.core.pipeline_parallel.schedules", "forward_backward_no_pipelining", 'device="cuda"', _T),
    CallSite(
        "megatron.core.pipeline_parallel.schedules",
        "forward_backward_pipelining_without_interleaving",
        'device="cuda"',
        _T,
    ),
    CallSite(_P2P, "P2PCommunicator._communicate_shapes", "torch.cuda.current_device()", _T),
    CallSite(_P2P, "P2PCommunicator._communicate", "torch.cuda.synchronize()", _T),
    CallSite(_P2P, "P2PCommunicator._communicate.<locals>.create_tensor_recv_prev", "torch.cuda.current_device()", _T),
    CallSite(_P2P, "P2PCommunicator._communicate.<locals>.create_tensor_recv_next", "torch.cuda.current_device()", _T),
    # Gradient norm and clipping.
    CallSite("megatron.core.utils", "local_multi_tensor_l2_norm", 'device="cuda"', _T),
    CallSite("megatron.core.optimizer.clip_grads", "get_grad_norm_fp32", "device='cuda'", _T),
    CallSite(
        "megatron.core.optimizer.clip_grads",
        "clip_grad_by_total_norm_fp32",
        "'torch.cuda.FloatTensor'",
        "CPU gradient clipping",
    ),
    # The mixed-precision and distributed optimizers: CUDA tensor type names, their unit loss scale.
    CallSite(_OPT, "MixedPrecisionOptimizer.__init__", "device='cuda'", _T),
    CallSite(_OPT, "Float16OptimizerWithFloat16Params.__init__", "param.type()", _TYPES),
    CallSite(_DOPT, "DistributedOptimizer.__init__", "param.type()", _TYPES),
    CallSite(_DOPT, "DistributedOptimizer._build_model_and_main_param_groups", "model_param.type()", _TYPES),
    # Tied word embeddings across pipeline stages.
    CallSite(
        "megatron.core.models.common.language_module.language_module",
        "LanguageModule.setup_embeddings_and_output_layer",
        "weight.data.cuda()",
        "Tensor.cuda as identity",
    ),
    # Mixture of experts: the router's weight placement, the all-to-all's output buffer, and the
    # all-to-all dispatcher's side stream for its device-to-host copies of the token counts.
    CallSite("megatron.core.transformer.moe.router", "Router.gating", "torch.cuda.current_device()", _T),
    CallSite("megatron.core.tensor_parallel.mappings", "_AllToAll.forward", "torch.cuda.current_device()", _T),
    CallSite("megatron.core.tensor_parallel.mappings", "_gather_along_first_dim", "torch.cuda.current_device()", _T),
    CallSite(_TD, "MoEAlltoAllTokenDispatcher.__init__", "torch.cuda.Stream()", _T),
    CallSite(_TD, "MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize", "torch.cuda.current_stream()", _T),
    CallSite(_TD, "MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize", "torch.cuda.stream(", _T),
    # ... whose split sizes become numpy arrays (what all_to_all_single accepts) only when they were CUDA tensors.
    CallSite(
        "megatron.core.transformer.moe.moe_utils", "maybe_move_tensor_to_cpu", "tensor.is_cuda", "CPU split sizes"
    ),
    # Sequence parallelism: the reduce-scatter of activations (forward) and of input gradients (backward).
    CallSite(
        "megatron.core.tensor_parallel.mappings", "_reduce_scatter_along_first_dim", "torch.cuda.current_device()", _T
    ),
    CallSite(
        "megatron.core.tensor_parallel.layers",
        "LinearWithGradAccumulationAndAsyncCommunication.backward",
        "torch.cuda.current_device()",
        _T,
    ),
    # Distributed checkpoint saving.
    CallSite(
        "megatron.core.dist_checkpointing.strategies.filesystem_async",
        "FileSystemWriterAsync.preload_tensors",
        "torch.cuda.synchronize()",
        _T,
    ),
    CallSite(
        "megatron.core.dist_checkpointing.strategies.state_dict_saver",
        "save_state_dict_async_finalize",
        "torch.cuda.current_device()",
        _T,
    ),
)

#: Modules whose global ``torch`` becomes :class:`_CpuTorch`: exactly those of the call sites above.
REDIRECTED_MODULES: tuple[str, ...] = tuple(sorted({site.module for site in CALL_SITES if site.redirect == _T}))

#: torch functions that take a ``device`` argument and are called with a CUDA device in the modules above.
_FACTORIES = ("empty", "zeros", "ones", "full", "tensor")

_CPU = None  # torch.device("cpu"), set on first use (this module imports no torch at import time)
_applied = False
_lock = threading.Lock()
#: ``(module, function)`` of every megatron function that went through a redirect in this process.
_OBSERVED: set[tuple[str, str]] = set()


def _record(depth: int = 2) -> None:
    """Note the function ``depth`` frames up (the megatron caller) as a redirected call site."""
    frame = sys._getframe(depth)
    code = frame.f_code  # co_qualname is Python 3.11's; on 3.10 the bare name is what there is
    _OBSERVED.add((frame.f_globals.get("__name__", "?"), getattr(code, "co_qualname", code.co_name)))


def observed_call_sites() -> list[tuple[str, str]]:
    """The call sites redirected so far in this process (tests compare them with :data:`CALL_SITES`)."""
    return sorted(_OBSERVED)


def _cpu_device() -> Any:
    global _CPU
    if _CPU is None:
        import torch

        _CPU = torch.device("cpu")
    return _CPU


def _is_cuda(device: Any) -> bool:
    import torch

    if isinstance(device, int):  # a CUDA device index, as torch.cuda.current_device() returns
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def _cpu_factory(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def factory(*args: Any, **kwargs: Any) -> Any:
        if _is_cuda(kwargs.get("device")):
            _record()
            kwargs["device"] = _cpu_device()
            kwargs.pop("pin_memory", None)
        return fn(*args, **kwargs)

    return factory


class _CpuStream:
    """The one in-order CPU "stream": waiting on it or for its events returns at once (the work is done)."""

    def wait_stream(self, other: Any) -> None:
        pass

    def record_event(self, *_: Any) -> _CpuStream:
        return self

    def synchronize(self) -> None:
        pass


_CPU_STREAM = _CpuStream()


class _CpuCuda:
    """``torch.cuda`` as the redirected modules see it on a CPU-only process.

    Only the functions megatron calls on its CPU-relevant paths are redefined;
    anything else falls through to the real ``torch.cuda`` (and fails there as
    it would have, instead of silently doing nothing).
    """

    def __getattr__(self, name: str) -> Any:
        import torch

        return getattr(torch.cuda, name)

    @staticmethod
    def current_device() -> Any:
        _record()
        return _cpu_device()

    @staticmethod
    def synchronize(*_: Any, **__: Any) -> None:
        """CPU kernels run synchronously: there is nothing to wait for."""
        _record()

    @staticmethod
    def empty_cache() -> None:
        """The CPU allocator has no cache to release."""
        _record()

    @staticmethod
    def get_rng_state(*_: Any, **__: Any) -> Any:
        _record()
        import torch

        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: Any, *_: Any, **__: Any) -> None:
        _record()
        import torch

        torch.set_rng_state(state)

    @staticmethod
    def Stream(*_: Any, **__: Any) -> _CpuStream:  # noqa: N802 - torch.cuda's name
        """CPU work runs in order on one stream: every "side stream" is that one."""
        _record()
        return _CPU_STREAM

    @staticmethod
    def current_stream(*_: Any, **__: Any) -> _CpuStream:
        _record()
        return _CPU_STREAM

    @staticmethod
    def stream(*_: Any, **__: Any) -> contextlib.nullcontext[None]:
        _record()
        return contextlib.nullcontext()

    @staticmethod
    def manual_seed(seed: int) -> None:
        _record()
        import torch

        torch.manual_seed(seed)


class _CpuTorch(types.ModuleType):
    """The ``torch`` module with CUDA allocations redirected to CPU (see the module docstring)."""

    def __init__(self) -> None:
        import torch

        super().__init__("torch", "torch as megatron-core sees it on a CPU-only process (rl_megatron.cpu_compat)")
        self.cuda = _CpuCuda()
        for name in _FACTORIES:
            setattr(self, name, _cpu_factory(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        import torch

        return getattr(torch, name)


def _get_cpu_rng_state(*_: Any, **__: Any) -> Any:
    """Replacement of ``tensor_parallel.random._get_cuda_rng_state``: the CPU generator's state."""
    import torch

    _record()
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: Any, *_: Any, **__: Any) -> None:
    """Replacement of ``tensor_parallel.random._set_cuda_rng_state``."""
    import torch

    _record()
    torch.set_rng_state(new_state)


def _clip_grad_by_total_norm_fp32(
    parameters: Any, max_norm: float, total_norm: float, use_decoupled_grad: bool = False
) -> None:
    """``clip_grad_by_total_norm_fp32`` without the CUDA tensor-type assert: scale fp32 grads in place."""
    import torch
    from megatron.core.utils import to_local_if_dtensor

    _OBSERVED.add(("megatron.core.optimizer.clip_grads", "clip_grad_by_total_norm_fp32"))
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = []
    for param in parameters:
        grad = getattr(param, attr, None)
        if grad is not None:
            assert grad.dtype == torch.float32, f"expected float32 gradients, got {grad.dtype}"
            grads.append(to_local_if_dtensor(grad).detach())
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        for grad in grads:
            grad.mul_(clip_coeff)


@contextlib.contextmanager
def _tensor_cuda_is_identity() -> Iterator[None]:
    import torch

    original = torch.Tensor.cuda

    def identity(self: Any, *args: Any, **kwargs: Any) -> Any:
        _OBSERVED.add((LANGUAGE_MODULE, "LanguageModule.setup_embeddings_and_output_layer"))
        return self

    torch.Tensor.cuda = identity  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.cuda = original  # type: ignore[method-assign]


_type_lock = threading.RLock()


@contextlib.contextmanager
def _tensor_type_names_cuda() -> Iterator[None]:
    """``Tensor.type()`` of a CPU tensor names the CUDA type of its dtype (``'torch.cuda.BFloat16Tensor'``) for
    the duration; with an argument (a conversion) or on a CUDA tensor it is the real method."""
    import torch

    with _type_lock:
        original = torch.Tensor.type
        if getattr(original, "__rl_megatron_cpu__", False):  # already inside one of the wrapped constructors
            yield
            return

        @functools.wraps(original)
        def type_name(self: Any, *args: Any, **kwargs: Any) -> Any:
            if args or kwargs or self.is_cuda:
                return original(self, *args, **kwargs)
            _record()
            return original(self).replace("torch.", "torch.cuda.", 1)

        type_name.__rl_megatron_cpu__ = True  # type: ignore[attr-defined]
        torch.Tensor.type = type_name  # type: ignore[method-assign]
        try:
            yield
        finally:
            torch.Tensor.type = original  # type: ignore[method-assign]


def _with_cuda_type_names(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with _tensor_type_names_cuda():
            return method(*args, **kwargs)

    wrapped.__rl_megatron_cpu__ = True  # type: ignore[attr-defined]
    return wrapped


LANGUAGE_MODULE = "megatron.core.models.common.language_module.language_module"


def _wrap_setup_embeddings(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def setup_embeddings_and_output_layer(self: Any, *args: Any, **kwargs: Any) -> Any:
        with _lock, _tensor_cuda_is_identity():
            return method(self, *args, **kwargs)

    setup_embeddings_and_output_layer.__rl_megatron_cpu__ = True  # type: ignore[attr-defined]
    return setup_embeddings_and_output_layer


def _to_cpu_also_numpy(original: Callable[..., Any]) -> Callable[..., Any]:
    """``maybe_move_tensor_to_cpu`` that gives numpy (``as_numpy``) for a tensor already on CPU too: the
    all-to-all dispatcher's split sizes then reach ``all_to_all_single`` as a sequence of ints, as on a GPU."""

    @functools.wraps(original)
    def maybe_move_tensor_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        import torch

        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            _OBSERVED.add(("megatron.core.transformer.moe.moe_utils", "maybe_move_tensor_to_cpu"))
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return maybe_move_tensor_to_cpu


def is_applied() -> bool:
    return _applied


def apply() -> None:
    """Install the redirects in this process (idempotent). Refuses to run where CUDA is available."""
    global _applied
    import torch

    if torch.cuda.is_available():
        raise RuntimeError("rl_megatron.cpu_compat is for processes without a GPU; CUDA is available here")
    with _lock:
        if _applied:
            return
        cpu_torch = _CpuTorch()
        for name in REDIRECTED_MODULES:
            module = importlib.import_module(name)
            module.torch = cpu_torch  # type: ignore[attr-defined]

        from megatron.core.tensor_parallel import random as tp_random

        tp_random._get_cuda_rng_state = _get_cpu_rng_state
        tp_random._set_cuda_rng_state = _set_cpu_rng_state

        from megatron.core.optimizer import optimizer as megatron_optimizer

        megatron_optimizer.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32

        from megatron.core.models.common.language_module.language_module import LanguageModule

        LanguageModule.setup_embeddings_and_output_layer = _wrap_setup_embeddings(
            LanguageModule.setup_embeddings_and_output_layer
        )
        from megatron.core.transformer.moe import token_dispatcher

        token_dispatcher.maybe_move_tensor_to_cpu = _to_cpu_also_numpy(token_dispatcher.maybe_move_tensor_to_cpu)
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        for cls in (megatron_optimizer.Float16OptimizerWithFloat16Params, DistributedOptimizer):
            cls.__init__ = _with_cuda_type_names(cls.__init__)
        _applied = True


__all__ = ["CALL_SITES", "REDIRECTED_MODULES", "CallSite", "apply", "is_applied", "observed_call_sites"]
