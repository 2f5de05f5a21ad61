"""Wrapping a Hugging Face causal LM in FSDP1, and reading/writing its full parameters by HF name.

Why the pieces look the way they do:

- Auto-wrap unit = the model's decoder-layer class (from HF's
  ``_no_split_modules``), so at most one layer is gathered at a time; the
  embeddings, final norm and LM head (tied or not) stay in the root unit.
  LoRA adapter matrices are units of their own (:func:`wrap_policy`).
- ``use_orig_params=False``: ``model.parameters()`` are the FSDP *flat*
  parameters, i.e. exactly this rank's shards. The optimizer, the gradient
  norm, the reference-model snapshot and the offload hooks all work on them
  directly, with no per-parameter bookkeeping. Elementwise optimizers (SGD,
  Adam[W]) give the same update on a flat shard as on the original tensors.
- Full tensors are read (refit, checkpoints) and written (``load_checkpoint``)
  one FSDP unit at a time with ``summon_full_params(unit, recurse=False)``,
  never the whole model at once. FSDP1's full ``state_dict`` is not used: with
  ``offload_to_cpu=True`` it segfaults on CPU (design.md §5), and without it it
  gathers every parameter on every rank at once.
- FSDP1 keeps the root unit's parameters gathered after a forward (it
  expects a backward to follow), so after a no-grad pass the root's full
  parameters stay cached and the next forward reuses them without
  re-gathering. Whoever writes the shards directly (the reference-model swap,
  offloading) must drop that cache first: :func:`release_gathered_params`.
- FSDP1's own CPU offload needs an accelerator (its init touches one): on a
  CPU-only machine the parameters already live in host memory, so
  ``fsdp_offload_enabled`` is a no-op there (reported by :func:`fsdp_kwargs`).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffload, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import CustomPolicy

from rlcore.training.worker_base import DTYPES

#: Attribute names under which wrappers keep the module they wrap (FSDP, activation checkpointing).
_WRAPPED_ATTRS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module")


def decoder_layer_classes(model: nn.Module) -> set[type]:
    """The transformer-layer classes to wrap as FSDP units.

    HF models list them in ``_no_split_modules``; models that do not are
    wrapped by any class named ``*DecoderLayer``. An empty set means a single
    FSDP unit (the whole model), which is correct, only less memory-frugal.
    """
    names = set(getattr(model, "_no_split_modules", None) or ())
    classes = {type(m) for m in model.modules() if type(m).__name__ in names}
    if not classes:
        classes = {type(m) for m in model.modules() if type(m).__name__.endswith("DecoderLayer")}
    return classes


def fsdp_kwargs(model: nn.Module, device: torch.device, precision: str, offload: bool) -> tuple[dict, list[str]]:
    """Keyword arguments of ``FullyShardedDataParallel`` for ``model``, and notes on settings not applied.

    Mixed precision computes in ``precision`` and reduces gradients in float32
    (summed gradients must not lose bits to bf16); buffers (e.g. rotary
    ``inv_freq``) keep their own dtype.
    """
    notes = []
    dtype = DTYPES[precision]
    mixed = None if dtype == torch.float32 else MixedPrecision(param_dtype=dtype, reduce_dtype=torch.float32)
    cpu_offload = None
    if offload:
        if device.type == "cpu":
            notes.append("fsdp_offload_enabled has no effect on CPU: parameters already live in host memory")
        else:
            cpu_offload = CPUOffload(offload_params=True)
    kwargs = dict(
        auto_wrap_policy=wrap_policy(model),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        mixed_precision=mixed,
        cpu_offload=cpu_offload,
        device_id=device,  # required on CPU too (design.md §5)
        use_orig_params=False,
        sync_module_states=False,  # every rank loaded the same checkpoint
        limit_all_gathers=True,
    )
    return kwargs, notes


def wrap_policy(model: nn.Module) -> CustomPolicy | None:
    """One FSDP unit per decoder layer, a vision-language model's tower (:func:`vision_tower_ids`) and, with LoRA,
    one per adapter matrix.

    A flat parameter is all trainable or all frozen (with ``use_orig_params=False``),
    so the adapters (trainable) get units of their own inside the layer's unit
    (frozen base weights); the optimizer then sees only the adapter units' shards.
    """
    from rlcore.training.lora import lora_layers

    layers = tuple(decoder_layer_classes(model))
    adapters = {id(m) for layer in lora_layers(model).values() for m in (layer.lora_A, layer.lora_B)}
    units = adapters | vision_tower_ids(model)
    if not layers and not units:
        return None
    return CustomPolicy(lambda module: isinstance(module, layers) or id(module) in units)


def vision_tower_ids(model: nn.Module) -> set[int]:
    """A vision-language model's whole tower as a unit (its blocks are units already, from
    ``_no_split_modules``): its patch embedding and merger then share no flat parameter with the language
    model, so ``policy.freeze_vision_tower`` freezes whole flat parameters."""
    from rlcore.training.vision import vision_tower_path

    path = vision_tower_path(model)
    return set() if path is None else {id(model.get_submodule(path))}


def release_gathered_params(model: FSDP) -> None:
    """Free the full parameters FSDP1 keeps gathered between passes, so the next pass re-gathers the shards.

    Only the root unit is left gathered after a forward (see the module
    docstring). Uses FSDP1's internal reshard (no public API does this);
    call it only between passes, never between a forward and its backward.
    """
    from torch.distributed.fsdp._runtime_utils import _reshard

    for unit in FSDP.fsdp_modules(model):
        handle = unit._handle
        if handle is None or not hasattr(handle.flat_param, "_full_param_padded"):
            continue  # before the first pass (FSDP1 initialises lazily) nothing was ever gathered
        if handle.uses_sharded_strategy and not handle.needs_unshard():
            _reshard(unit, handle, True)


def repoint_unsharded_views(model: FSDP) -> None:
    """After a flat parameter moved, point its modules' weights at the new storage.

    With one rank FSDP1 does not shard (``NO_SHARD``): the flat parameter is the
    full parameter, and the module attributes (``linear.weight``) stay views of it
    between passes. Views of the old storage would keep it allocated: the move
    would free nothing. Sharded units need nothing here: their views point into
    the gathered buffer, which :func:`release_gathered_params` frees.
    """
    for unit in FSDP.fsdp_modules(model):
        handle = unit._handle
        if handle is not None and not handle.uses_sharded_strategy:
            handle._use_unsharded_views(as_params=False)


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each decoder layer in backward (non-reentrant checkpointing, inside the FSDP units)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
    )
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing as apply,
    )

    layers = tuple(decoder_layer_classes(model))
    if not layers:
        raise ValueError("activation_checkpointing_enabled: no decoder-layer class found to checkpoint")
    apply(
        model,
        checkpoint_wrapper_fn=partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, layers),
    )


def unwrap(module: nn.Module) -> nn.Module:
    """The module inside any FSDP / activation-checkpoint wrappers."""
    while True:
        inner = next((getattr(module, a) for a in _WRAPPED_ATTRS if a in module._modules), None)
        if inner is None:
            return module
        module = inner


def clean_name(name: str) -> str:
    """A parameter/module name with the wrapper segments removed (the HF name)."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPED_ATTRS)


def resolve(root: nn.Module, hf_name: str) -> torch.Tensor:
    """The tensor named ``hf_name`` (relative to ``root``), looking through wrappers."""
    *path, leaf = hf_name.split(".")
    module = unwrap(root)
    for part in path:
        module = unwrap(module._modules[part])
    return getattr(module, leaf)


@contextlib.contextmanager
def unwrapped_view(model: FSDP) -> Iterator[nn.Module]:
    """The plain HF model with every nested wrapper temporarily taken out of the module tree.

    Use it inside ``FSDP.summon_full_params(model)``: calling a nested FSDP
    unit's forward there reshards it and breaks the summon (and HF
    ``generate`` cannot run on the wrapped root), while the plain modules see
    the gathered full parameters. The wrappers are put back on exit.
    """
    swapped: list[tuple[nn.Module, str, nn.Module]] = []

    def strip(parent: nn.Module) -> None:
        for name, child in list(parent._modules.items()):
            if child is None:
                continue
            inner = unwrap(child)
            if inner is not child:
                parent._modules[name] = inner
                swapped.append((parent, name, child))
            strip(inner)

    root = unwrap(model)
    try:
        strip(root)
        yield root
    finally:
        for parent, name, child in reversed(swapped):
            parent._modules[name] = child


@dataclass
class ParamLayout:
    """The HF names, shapes and dtypes of a model, and which FSDP unit owns each parameter.

    Recorded from the plain model before wrapping (afterwards the parameters
    are flat shards). ``names`` is the deterministic export order: the HF
    ``state_dict`` order, without tied duplicates (``lm_head.weight`` when the
    embeddings are tied, as ``save_pretrained`` does) and without
    non-persistent buffers.
    """

    names: list[str]
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype]
    buffers: set[str]
    tied: dict[str, str]  # dropped duplicate name -> the name it aliases
    owners: dict[str, str] = field(default_factory=dict)  # parameter name -> owning unit's HF prefix
    units: dict[str, FSDP] = field(default_factory=dict)

    @classmethod
    def from_model(cls, model: nn.Module) -> ParamLayout:
        params = dict(model.named_parameters(remove_duplicate=False))
        unique_params = dict(model.named_parameters())
        names, shapes, dtypes, buffers, tied = [], {}, {}, set(), {}
        first_by_storage: dict[tuple[int, tuple], str] = {}
        for name, tensor in model.state_dict(keep_vars=True).items():
            key = (tensor.data_ptr(), tuple(tensor.shape))
            if name in params and name not in unique_params or key in first_by_storage:
                tied[name] = first_by_storage.get(key, name)
                continue
            first_by_storage[key] = name
            names.append(name)
            shapes[name] = tuple(tensor.shape)
            dtypes[name] = tensor.dtype
            if name not in params:
                buffers.add(name)
        return cls(names, shapes, dtypes, buffers, tied)

    def bind(self, model: FSDP) -> None:
        """Find the FSDP units of the wrapped ``model`` and the unit owning each parameter; initialise FSDP1 from
        the root now (it does so lazily on first use, and would take a nested unit summoned first, such as a
        VLM's tower, whose parameters come first in the state dict, for a root)."""
        from torch.distributed.fsdp._runtime_utils import _lazy_init

        _lazy_init(model, model)
        self.units = {clean_name(n): m for n, m in model.named_modules() if isinstance(m, FSDP)}
        prefixes = sorted(self.units, key=len, reverse=True)
        for name in self.names:
            if name in self.buffers:
                continue
            self.owners[name] = next(p for p in prefixes if p == "" or name.startswith(p + "."))

    def _relative(self, name: str) -> str:
        prefix = self.owners[name]
        return name[len(prefix) + 1 :] if prefix else name

    def iter_full(self, model: FSDP, names: list[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(hf_name, full tensor)`` in ``names`` order (default: all), gathering one unit at a time.

        Collective: every rank must iterate to the end. A yielded parameter is
        a view of gathered storage that is freed when the iteration moves to
        the next unit: copy what you keep.
        """
        names = self.names if names is None else names
        for owner, group in itertools.groupby(names, key=lambda n: self.owners.get(n)):
            if owner is None:  # buffers are never sharded
                for name in group:
                    yield name, resolve(model, name)
                continue
            unit = self.units[owner]
            with FSDP.summon_full_params(unit, recurse=False, writeback=False):
                for name in group:
                    yield name, resolve(unit, self._relative(name)).detach()

    def load_full(self, model: FSDP, state: dict[str, torch.Tensor], only: Callable[[str], bool] | None = None) -> None:
        """Copy full HF-named tensors into the sharded model (collective: every rank, same ``state``).

        ``only`` limits the load to the names it accepts (a LoRA adapter
        checkpoint holds only the adapters). Tied duplicates may be absent from
        ``state``; anything else missing, or an unexpected name, raises KeyError naming it.
        """
        release_gathered_params(model)
        names = [n for n in self.names if only is None or only(n)]
        missing = [n for n in names if n not in state]
        unexpected = sorted(set(state) - set(names) - set(self.tied))
        if missing or unexpected:
            raise KeyError(f"checkpoint does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
        with torch.no_grad():
            for name in (n for n in names if n in self.buffers):
                buffer = resolve(model, name)
                buffer.copy_(state[name].to(buffer.device, buffer.dtype))
            params = [n for n in names if n not in self.buffers]
            for owner, group in itertools.groupby(params, key=lambda n: self.owners[n]):
                unit = self.units[owner]
                with FSDP.summon_full_params(unit, recurse=False, writeback=True):
                    for name in group:
                        target = resolve(unit, self._relative(name))
                        target.copy_(state[name].to(target.device, target.dtype))
