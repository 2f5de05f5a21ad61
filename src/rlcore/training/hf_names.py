"""The checkpoint's tensor names of a transformers model whose in-memory layout differs from its files.

transformers 5 loads some architectures into fused parameters and writes the files' layout back in
``save_pretrained``: a mixture-of-experts' experts live as one ``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` and
one ``mlp.experts.down_proj`` per layer, while the checkpoint holds ``mlp.experts.<e>.gate_proj.weight``,
``up_proj`` and ``down_proj`` per expert. Refit (design.md §2.7) and checkpoints (§2.8) speak the checkpoint's
names, the ones a generation engine and every Hugging Face tool load; :class:`CheckpointNames` maps a stream of
in-memory tensors to them one tensor at a time, with transformers' own reverse conversion. A model whose
in-memory names are the checkpoint's (every dense model) passes through untouched.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedModel


class CheckpointNames:
    """Maps ``(in-memory name, tensor)`` pairs of ``model`` to the checkpoint's pairs, in a deterministic order."""

    def __init__(self, model: PreTrainedModel) -> None:
        from transformers.core_model_loading import PrefixChange

        self._model = model
        mapping = pin_conversions(model)  # what save_pretrained reverses
        self.converts = any(not isinstance(step, PrefixChange) for step in mapping)

    def tensors(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors for each in-memory one (a fused tensor becomes its per-expert parts)."""
        if not self.converts:
            yield from named
            return
        from transformers.core_model_loading import revert_weight_conversion

        for name, tensor in named:
            for out_name, out in revert_weight_conversion(self._model, {name: tensor}).items():
                yield out_name, out.contiguous()

    def read(self, weights_path: str, config: PretrainedConfig) -> dict[str, torch.Tensor]:
        """A checkpoint's tensors under the in-memory names: read as they are, or, where the files' layout differs
        (a MoE's per-expert tensors, a VLM's ``visual.*``), through transformers' loader (safetensors only)."""
        import torch

        from rlcore.training.checkpoint import load_hf_state_dict
        from rlcore.training.checkpoint_files import check_inside
        from rlcore.training.vision import model_class

        if not self.converts:
            return load_hf_state_dict(weights_path)
        check_inside(weights_path)  # a checkpoint reads its own files only
        loaded = model_class(config).from_pretrained(
            weights_path, config=config, dtype=torch.float32, use_safetensors=True
        )
        return loaded.state_dict()

    def shapes(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        """The checkpoint's ``{name: shape}`` for in-memory ``shapes`` (on the meta device: no memory)."""
        import torch

        if not self.converts:
            return dict(shapes)
        metas = ((name, torch.empty(shape, device="meta")) for name, shape in shapes.items())
        return {name: tuple(t.shape) for name, t in self.tensors(metas)}


def pin_conversions(model: PreTrainedModel) -> list:
    """The model's weight conversions, recorded on it (``_weight_conversions``, where ``from_pretrained`` keeps
    them) unless already there. transformers looks many mappings up by class name (Qwen2.5-VL's ``visual.*`` ->
    ``model.visual.*``), and FSDP2 renames the class it shards: call this before ``fully_shard``."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange

    recorded = getattr(model, "_weight_conversions", None)
    if recorded is not None:
        return list(recorded)
    # As revert_weight_conversion does for a model not built by from_pretrained: no PrefixChange.
    mapping = [
        step for step in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(step, PrefixChange)
    ]
    if mapping:
        setattr(model, "_weight_conversions", mapping)  # noqa: B010 - transformers' attribute, not the class's
    return mapping


__all__ = ["CheckpointNames", "pin_conversions"]
