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
    from transformers import PreTrainedModel


class CheckpointNames:
    """Maps ``(in-memory name, tensor)`` pairs of ``model`` to the checkpoint's pairs, in a deterministic order."""

    def __init__(self, model: PreTrainedModel) -> None:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange

        self._model = model
        mapping = get_model_conversion_mapping(model, add_legacy=False)  # what save_pretrained reverses
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

    def shapes(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        """The checkpoint's ``{name: shape}`` for in-memory ``shapes`` (on the meta device: no memory)."""
        import torch

        if not self.converts:
            return dict(shapes)
        metas = ((name, torch.empty(shape, device="meta")) for name, shape in shapes.items())
        return {name: tuple(t.shape) for name, t in self.tensors(metas)}


__all__ = ["CheckpointNames"]
