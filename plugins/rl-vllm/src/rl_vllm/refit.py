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
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
from collections.abc import Iterable
from typing import Any

from rlcore.refit import RefitError


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
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            return bool(json.load(f).get("tie_word_embeddings", False))
    except (OSError, ValueError):
        return False


def metadata_problems(metadata: Metadata, model_dir: str, partial: bool = False) -> list[str]:
    """How refit info disagrees with the engine's own checkpoint (names and shapes); empty when it fits.

    Checked when the info arrives, so a refit that cannot fit is refused
    before any weight changes. Without a checkpoint on disk (``load_format:
    dummy`` on a bare config) there is nothing to compare with; the check
    after loading (every engine parameter updated) still applies.
    """
    shapes = checkpoint_shapes(model_dir)
    if shapes is None:
        return []
    problems = []
    # A tied LM head's duplicate may be sent or not (vLLM loads the embedding it shares either way).
    optional = {"lm_head.weight"} if tied_word_embeddings(model_dir) else set()
    if not partial and (missing := sorted(set(shapes) - set(metadata) - optional)):
        problems.append(f"refit info lacks {len(missing)} tensor(s) of the engine's model: {', '.join(missing[:5])}")
    if extra := sorted(set(metadata) - set(shapes) - optional):
        problems.append(f"refit info has {len(extra)} tensor(s) the engine's model does not: {', '.join(extra[:5])}")
    wrong = [
        f"{n}: sent {metadata[n][0]}, engine has {shapes[n]}"
        for n in sorted(set(metadata) & set(shapes))
        if tuple(metadata[n][0]) != tuple(shapes[n])
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


class InPlaceReload:
    """One in-place reload of an in-process engine's weights: ``load`` per bucket, then ``finish``.

    ``vllm_worker`` is the engine's own ``Worker`` object (reachable in
    process through ``LLM.collective_rpc``). If ``finish`` is never reached
    (the stream broke), ``abort`` still completes vLLM's reload bookkeeping so
    the model stays structurally whole; its weights are then a mix of old and
    new, and the caller must treat the engine as stale.
    """

    def __init__(self, vllm_worker: Any, partial: bool = False) -> None:
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
        self._open = True
        with self._config_ctx(vllm_worker.vllm_config):
            initialize_layerwise_reload(self.model)

    def load(self, named: Iterable[tuple[str, Any]]) -> None:
        batch = list(named)  # no copy: the transport keeps each tensor valid until its layer is whole
        with self._config_ctx(self._worker.vllm_config):
            loaded = self.model.load_weights(batch)
        self.tensors += len(batch)
        if loaded:
            self.loaded |= set(loaded)

    def _finalize(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if self._open:
            self._open = False
            try:
                with self._config_ctx(self._worker.vllm_config):
                    finalize_layerwise_reload(self.model, self._worker.vllm_config.model_config)
                    _reprocess_tied_head(self.model)
                    _repack_cpu_experts(self.model, self.loaded)
            finally:
                self._quiet.__exit__(None, None, None)

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
