"""Engine side of a weight refit: load HF-named tensors in place into the in-process vLLM model.

Why not ``param.copy_(tensor)``: vLLM models do not hold HF-shaped
parameters. q/k/v land in one fused ``qkv_proj``, gate/up in ``gate_up_proj``,
and on CPU every linear layer's weight is repacked for the GEMM kernel after
loading (the ``weight`` parameter itself is emptied). The model's own
``load_weights`` knows the name mapping, and vLLM's layerwise reload
(``initialize_layerwise_reload`` / ``finalize_layerwise_reload``, the pieces of
``Worker.reload_weights``) restores each layer to checkpoint format, loads
it, re-runs its post-load processing (repacking) and copies the result into
the tensors the engine already uses. :class:`InPlaceReload` runs those steps
bucket by bucket, so a refit streams instead of first collecting every tensor.

A layer is processed only once all of its weights have arrived; until then
vLLM keeps references to the tensors it was given. Buckets arrive in reused
transport buffers, so the transports cut buckets between decoder layers and
copy only the tensors of a layer too large for one bucket
(:func:`rlcore.refit.buckets.split_layer_names`): everything else is handed
over as a view, with no copy.

A rank of a tensor-parallel engine reads only its shard of most tensors (the
loaders ``narrow`` them). :class:`ReadRegions` records, during one reload,
which slice of each tensor the loaders read; later colocated refits then write
only those slices (``rlcore.refit.buckets.Region``).
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
from bisect import bisect_right
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from rlcore.models import has_vision_config, read_config_json
from rlcore.refit import RefitError
from rlcore.refit.buckets import Region, Regions
from rlcore.training.vision import TOWER_NAMES

if TYPE_CHECKING:
    import torch


class EngineStaleError(RuntimeError):
    """The engine's weights are not the ones it was asked to hold (a refit failed part-way)."""


#: ``{hf_name: (shape, dtype name)}``, as ``prepare_refit_info`` exchanges it.
Metadata = dict[str, tuple[tuple[int, ...], str]]


def normalize_metadata(info: dict[str, Any]) -> Metadata:
    """Shapes as int tuples and dtypes as names (``"float32"``, not ``torch.float32``)."""
    if not isinstance(info, dict) or not info:
        raise RefitError(f"refit info must be a non-empty {{name: (shape, dtype)}} dict, got {type(info).__name__}")
    out: Metadata = {}
    for name, entry in info.items():
        try:
            shape, dtype = entry
            out[str(name)] = (tuple(int(d) for d in shape), str(dtype).removeprefix("torch."))
        except (TypeError, ValueError) as exc:
            raise RefitError(f"refit info entry {name!r} is not (shape, dtype): {entry!r}") from exc
    return out


def checkpoint_shapes(model_dir: str) -> dict[str, tuple[int, ...]] | None:
    """``{name: shape}`` of the safetensors checkpoint in ``model_dir`` (headers only); None if there is none."""
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        return None
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def tied_word_embeddings(model_dir: str) -> bool:
    return bool((read_config_json(model_dir) or {}).get("tie_word_embeddings", False))


#: A vision-language model's names as ``state_dict()`` gives them (transformers >= 4.52) and as
#: ``save_pretrained`` writes them (the original layout): vLLM's loader takes both.
_VLM_PREFIXES = (("model.language_model.", "model."), ("model.visual.", "visual."))


def checkpoint_name(name: str, vision: bool) -> str:
    """``name`` in the checkpoint's layout: for a vision-language model, a ``state_dict()`` name is mapped."""
    if vision:
        for new, old in _VLM_PREFIXES:
            if name.startswith(new):
                return old + name[len(new) :]
    return name


def is_tower_name(name: str) -> bool:
    """A tensor of the vision tower (``name`` in the checkpoint's layout)."""
    return name.split(".", 1)[0] in TOWER_NAMES


def without_tower(metadata: Metadata, model_dir: str) -> bool:
    """The refit sends no tensor of a vision-language model's tower (``policy.freeze_vision_tower``): the engine
    keeps the tower it loaded, so each refit loads only the language model (a partial reload)."""
    if not has_vision_config(model_dir):
        return False
    return not any(is_tower_name(checkpoint_name(name, True)) for name in metadata)


def tower_copies(named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """``named`` with the vision tower's tensors copied out of the transport's buffer.

    vLLM's loader holds some of the tower's tensors past the bucket that brought them, beyond the one-layer
    window the transports keep valid (``rlcore.refit.buckets.layer_of`` keeps a vision block in one bucket, and
    that was not enough). Measured without the copies: image prompts' logprobs off by 0.12-0.36 after a refit,
    text prompts exact, in 3 runs of 3. The tower is a small part of a VLM's bytes.
    """
    return [(n, t.clone() if is_tower_name(checkpoint_name(n, True)) else t) for n, t in named]


def metadata_problems(metadata: Metadata, model_dir: str, partial: bool = False) -> list[str]:
    """How refit info disagrees with the engine's own checkpoint (names and shapes); empty when it fits.

    Checked when the info arrives, so a refit that cannot fit is refused
    before any weight changes. Without a checkpoint on disk (``load_format:
    dummy`` on a bare config) there is nothing to compare with; the check
    after loading (every engine parameter updated) still applies. A
    vision-language model's names may come in either layout (:func:`checkpoint_name`),
    and its vision tower may be left out whole (a frozen tower, :func:`without_tower`).
    """
    shapes = checkpoint_shapes(model_dir)
    if shapes is None:
        return []
    vision = has_vision_config(model_dir)
    sent = {checkpoint_name(name, vision): shape for name, (shape, _) in metadata.items()}
    problems = []
    # A tied LM head's duplicate may be sent or not (vLLM loads the embedding it shares either way).
    optional = {"lm_head.weight"} if tied_word_embeddings(model_dir) else set()
    if without_tower(metadata, model_dir):
        optional |= {name for name in shapes if is_tower_name(name)}
    if not partial and (missing := sorted(set(shapes) - set(sent) - optional)):
        problems.append(f"refit info lacks {len(missing)} tensor(s) of the engine's model: {', '.join(missing[:5])}")
    if extra := sorted(set(sent) - set(shapes) - optional):
        problems.append(f"refit info has {len(extra)} tensor(s) the engine's model does not: {', '.join(extra[:5])}")
    wrong = [
        f"{n}: sent {sent[n]}, engine has {shapes[n]}"
        for n in sorted(set(sent) & set(shapes))
        if tuple(sent[n]) != tuple(shapes[n])
    ]
    if wrong:
        problems.append(f"shape mismatch: {'; '.join(wrong[:5])}")
    return problems


@contextlib.contextmanager
def _quiet_unloaded_layers():
    """vLLM warns once per layer that got no weights in a reload; in a partial refit that is by design."""
    log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _reprocess_tied_head(model: Any) -> None:
    """Redo the post-load processing of an LM head tied to the input embeddings.

    The checkpoint (and so the refit) holds the embedding only; the tied head
    shares its weight tensor, which the reload updates in place, but on CPU
    vLLM packs the head's own copy for the logits GEMM when it loads, and
    nothing loaded into the head itself, so that copy would keep the old
    weights (engine logprobs then drift from the policy's after every refit).
    """
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    weight, tied_to = getattr(head, "weight", None), getattr(embed, "weight", None)
    method = getattr(head, "quant_method", None)
    if weight is None or tied_to is None or method is None or weight.data_ptr() != tied_to.data_ptr():
        return
    method.process_weights_after_loading(head)


def _repack_cpu_experts(model: Any, loaded: set[str]) -> None:
    """Redo the CPU packing of the fused expert weights that a reload loaded.

    vLLM 0.32's unquantized MoE method runs its experts' own post-load step
    (on CPU: packing ``w13``/``w2`` into the grouped-GEMM layout) only on the
    first load; on a weight update it copies the new weights in and skips it,
    so a refit would leave the CPU kernel reading unpacked weights (logprobs
    off by ~0.5 after a refit, and still off after refitting the original
    weights). Run it for every expert layer that got new weights.
    """
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # a build without the CPU MoE kernels: nothing of it to redo
        return
    for prefix, module in model.named_modules():
        experts = getattr(getattr(getattr(module, "quant_method", None), "moe_kernel", None), "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts) and f"{prefix}.w13_weight" in loaded:
            experts.process_weights_after_loading(module)


#: A tensor read whole, or in a way that is not one slice along one dimension.
_WHOLE: Region = (-1, 0, 0)


def _slice_read(tensor: torch.Tensor, view: torch.Tensor, offset: int) -> Region:
    """The slice of contiguous ``tensor`` that ``view`` (starting ``offset`` elements into it) covers, if it is
    ``tensor.narrow(dim, start, length)`` for some dim; else :data:`_WHOLE`."""
    shape, strides = tuple(tensor.shape), tensor.stride()
    if view.dim() != len(shape):
        return _WHOLE
    differ = [d for d in range(len(shape)) if view.shape[d] != shape[d]]
    if len(differ) != 1 or any(view.stride(d) != strides[d] for d in range(len(shape)) if view.shape[d] > 1):
        return _WHOLE
    dim = differ[0]
    start, rest = divmod(offset, strides[dim])
    if rest or start + view.shape[dim] > shape[dim]:
        return _WHOLE
    return dim, start, view.shape[dim]


def _union(a: Region, b: Region) -> Region:
    if a == _WHOLE or b == _WHOLE or a[0] != b[0]:
        return _WHOLE
    start, end = min(a[1], b[1]), max(a[1] + a[2], b[1] + b[2])
    return a[0], start, end - start


class ReadRegions:
    """Records which part of each tensor handed to vLLM's loaders they read, while :meth:`watch` is entered.

    Every aten op that reads data (not a view) with an argument inside a tracked tensor's memory counts as a
    read of the part that argument covers: a loader's ``copy_`` of ``tensor.narrow(dim, start, length)`` reads
    that slice; any other access counts as reading the whole tensor. :attr:`regions` keeps the tensors read
    as one slice along one dimension that is less than the whole. The tracked tensors are kept alive until
    the recorder goes, so no other tensor takes their memory while it watches.
    """

    def __init__(self) -> None:
        self._spans: list[tuple[int, int, str, torch.Tensor]] = []  # (first byte, end byte, name, tensor), sorted
        self._starts: list[int] = []
        self._kept: list[torch.Tensor] = []
        self._read: dict[str, Region] = {}

    def track(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Watch these tensors (a bucket's); a tracked tensor whose memory a new one reuses is dropped."""
        for name, tensor in named:
            if not tensor.numel() or not tensor.is_contiguous():
                continue
            first = tensor.data_ptr()
            end = first + tensor.numel() * tensor.element_size()
            self._spans = [s for s in self._spans if s[1] <= first or s[0] >= end] + [(first, end, name, tensor)]
            self._kept.append(tensor)
        self._spans.sort(key=lambda s: s[0])
        self._starts = [s[0] for s in self._spans]

    def note(self, arg: torch.Tensor) -> None:
        """An op read ``arg``: if it lies in a tracked tensor, widen that tensor's region to cover it."""
        if not arg.numel() or arg.device.type == "meta":
            return
        address = arg.data_ptr()
        at = bisect_right(self._starts, address) - 1
        if at < 0 or address >= self._spans[at][1]:
            return
        first, _, name, tensor = self._spans[at]
        read = _slice_read(tensor, arg, (address - first) // tensor.element_size())
        read = _union(self._read[name], read) if name in self._read else read
        self._read[name] = _WHOLE if read[2] == tensor.shape[read[0]] else read  # slices that add up to all

    @contextlib.contextmanager
    def watch(self) -> Iterator[None]:
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        recorder = self

        class _ReadMode(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                if not func.is_view:
                    for leaf in tree_leaves((args, kwargs)):
                        if isinstance(leaf, torch.Tensor):
                            recorder.note(leaf)
                return func(*args, **(kwargs or {}))

        with _ReadMode():
            yield

    @property
    def regions(self) -> Regions:
        return {name: region for name, region in self._read.items() if region != _WHOLE}


class InPlaceReload:
    """One in-place reload of an in-process engine's weights: ``load`` per bucket, then ``finish``.

    ``vllm_worker`` is the engine's own ``Worker`` object (reachable in
    process through ``LLM.collective_rpc``). If ``finish`` is never reached
    (the stream broke), ``abort`` still completes vLLM's reload bookkeeping so
    the model stays structurally whole; its weights are then a mix of old and
    new, and the caller must treat the engine as stale. ``record_regions``: a
    :class:`ReadRegions` fills :attr:`regions` with the slices the loaders read.
    """

    def __init__(self, vllm_worker: Any, partial: bool = False, record_regions: bool = False) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self._worker = vllm_worker
        self._config_ctx = set_current_vllm_config
        self.model = vllm_worker.model_runner.get_model()
        # A partial refit (LoRA) loads some layers; vLLM puts the others' weights back as they were.
        self.expected = set() if partial else {name for name, _ in self.model.named_parameters()}
        self._quiet = _quiet_unloaded_layers() if partial else contextlib.nullcontext()
        self._quiet.__enter__()
        self.loaded: set[str] = set()
        self.tensors = 0
        self._recorder = ReadRegions() if record_regions else None
        self._open = True
        with self._config_ctx(vllm_worker.vllm_config):
            initialize_layerwise_reload(self.model)

    def load(self, named: Iterable[tuple[str, Any]]) -> None:
        batch = list(named)  # no copy: the transport keeps each tensor valid until its layer is whole
        if self._recorder is not None:
            self._recorder.track(batch)
        with self._config_ctx(self._worker.vllm_config), self._watching():
            loaded = self.model.load_weights(batch)
        self.tensors += len(batch)
        if loaded:
            self.loaded |= set(loaded)

    def _finalize(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if self._open:
            self._open = False
            try:
                with self._config_ctx(self._worker.vllm_config), self._watching():
                    finalize_layerwise_reload(self.model, self._worker.vllm_config.model_config)
                    _reprocess_tied_head(self.model)
                    _repack_cpu_experts(self.model, self.loaded)
            finally:
                self._quiet.__exit__(None, None, None)

    def _watching(self) -> contextlib.AbstractContextManager[None]:
        return self._recorder.watch() if self._recorder is not None else contextlib.nullcontext()

    @property
    def regions(self) -> Regions:
        """The slices of tensors the loaders read, when recorded (empty otherwise)."""
        return self._recorder.regions if self._recorder is not None else {}

    def finish(self) -> None:
        """Complete the reload; raises :class:`RefitError` if some engine parameter got no new value."""
        self._finalize()
        if missing := sorted(self.expected - self.loaded):
            raise RefitError(f"{len(missing)} engine parameter(s) received no weights: {', '.join(missing[:5])}")

    def abort(self) -> None:
        try:
            self._finalize()
        except Exception:  # noqa: BLE001 - the engine is marked stale either way
            pass


def checkpoint_state(model_dir: str) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors checkpoint in ``model_dir``, in memory."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        state.update(load_file(path))
    return state


def timed_reload(vllm_worker: Any, state: dict[str, torch.Tensor], bucket_bytes: int) -> float:
    """Seconds of an in-place reload of ``state`` (already in memory) in a refit's bucket order: a refit's floor."""
    import time

    from rlcore.refit import metadata_of, plan_buckets

    plan = plan_buckets(metadata_of(state.items()), bucket_bytes)
    started = time.perf_counter()
    reload = InPlaceReload(vllm_worker)
    for bucket in plan:
        reload.load([(name, state[name]) for name in bucket.names])
    reload.finish()
    return time.perf_counter() - started
