"""Vision-language models in the training backends (capability ``image_inputs``, docs/vision.md).

- :func:`is_vision_language` / :func:`model_class`: a config with a ``vision_config`` is loaded with
  ``AutoModelForImageTextToText``, every other one with ``AutoModelForCausalLM``.
- :func:`vision_tower_path` / :func:`freeze_vision_tower`: the tower's module (``model.visual`` in
  Qwen2.5-VL) and ``policy.freeze_vision_tower``.
- :class:`VisionForward`: the model kwargs of a micro-batch with images (its rows' ``pixel_values`` and
  ``image_grid_thw`` concatenated in row order, ``mm_token_type_ids`` so Qwen2.5-VL derives its 3D rotary
  positions, no ``position_ids``), the position ids of a packed row (:meth:`VisionForward.packed_position_ids`),
  and the dummy image that keeps sharded ranks in step.

Why packed rows get their positions given: the model derives 3D rotary positions for each row of its input, and a
packed row holds several sequences, each of which starts again at 0. So each sequence's positions are computed by
the model's own ``get_rope_index`` on the padded micro-batch (one row per sequence, the same thing the model does
on its own for an unpacked forward) and laid out in the packed order, behind the packed text positions (Hugging
Face's ``[4, 1, T]`` form: row 0 restarts at every sequence, rows 1-3 are the 3D positions).

Why the dummy image: FSDP shards the tower in units of its own, and a unit's parameters are all-gathered
(and, in training, its gradients reduce-scattered) only by the ranks that run it. A rank whose micro-batch
has no image would skip the tower while its peers wait in the tower's collectives. So a forward without
images runs the tower on a one-token blank image just before the language model and adds ``0 x`` its
output to the text embeddings: the same collectives, in the same order, on every rank, and zero
gradients (not none) for the tower. The tower also cannot run on zero patches (Qwen2.5-VL's position
code concatenates an empty list).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn
    from transformers import PretrainedConfig

#: Attribute names under which Hugging Face VLMs keep their vision tower.
TOWER_NAMES = ("visual", "vision_tower", "vision_model")
#: Batch keys of image rows (docs/vision.md): per-row lists.
PIXEL_VALUES, IMAGE_GRID_THW = "pixel_values", "image_grid_thw"


def is_vision_language(config: PretrainedConfig) -> bool:
    """Whether ``config`` is an image-text model's (it has a ``vision_config``)."""
    return getattr(config, "vision_config", None) is not None


def model_class(config: PretrainedConfig) -> Any:
    """The ``transformers`` auto class that loads a checkpoint of ``config``."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM


def _shortest_module_path(model: nn.Module, names: tuple[str, ...]) -> str | None:
    paths = [path for path, _ in model.named_modules() if path.rsplit(".", 1)[-1] in names]
    return min(paths, key=len) if paths else None


def vision_tower_path(model: nn.Module) -> str | None:
    """The tower's module path in ``model`` (``model.visual`` in Qwen2.5-VL), None for a text model."""
    config: Any = getattr(model, "config", None)
    return _shortest_module_path(model, TOWER_NAMES) if is_vision_language(config) else None


def under(prefix: str | None, name: str) -> bool:
    """Whether the parameter ``name`` belongs to the module at ``prefix``."""
    return prefix is not None and name.startswith(prefix + ".")


def freeze_vision_tower(model: nn.Module) -> str:
    """Switch the tower's gradients off; returns its path. Raises for a model without one."""
    path = vision_tower_path(model)
    if path is None:
        raise ValueError(
            f"policy.freeze_vision_tower: {type(model).__name__} has no vision tower (not a vision-language "
            "model); set policy.freeze_vision_tower=false"
        )
    for param in model.get_submodule(path).parameters():
        param.requires_grad_(False)
    return path


def check_unsupported(
    config: PretrainedConfig,
    refused: Mapping[str, bool],
    backend: str = "training",
    fixes: Mapping[str, str] | None = None,
) -> None:
    """Refuse a vision-language model with any setting in ``refused`` (config key -> whether it is on) on
    ``backend``, in the config check's words (:func:`rlcore.config.vision.refusal`); ``fixes``: what to do
    instead, per key (default: switch it off)."""
    from rlcore.config.vision import refusal

    if not is_vision_language(config):
        return
    model = getattr(config, "_name_or_path", "") or type(config).__name__
    for key, on in refused.items():
        if on:
            raise ValueError(refusal(key, model, backend, (fixes or {}).get(key, "switch it off")))


def has_images(mb: Mapping[str, Any]) -> bool:
    """Whether any row of the micro-batch has an image patch."""
    return PIXEL_VALUES in mb and any(int(p.shape[0]) for p in mb[PIXEL_VALUES])


def image_inputs(mb: Mapping[str, Any], input_ids: torch.Tensor, image_token_id: int) -> dict[str, Any]:
    """The model kwargs of ``mb``'s images for a forward of ``input_ids`` (the rows in ``mb``'s order, in any
    padding): ``mm_token_type_ids`` (1 at image tokens), and, when any row has an image, the rows'
    ``pixel_values`` and ``image_grid_thw`` concatenated in row order."""
    import torch

    out: dict[str, Any] = {"mm_token_type_ids": (input_ids == image_token_id).int()}
    if has_images(mb):
        out[PIXEL_VALUES] = torch.cat(list(mb[PIXEL_VALUES])).to(input_ids.device)
        out[IMAGE_GRID_THW] = _grids(mb).to(input_ids.device)
    return out


def _grids(mb: Mapping[str, Any]) -> torch.Tensor:
    """The rows' ``image_grid_thw`` concatenated in row order, ``[images, 3]`` int64."""
    import torch

    return torch.cat([g.reshape(-1, 3) for g in mb[IMAGE_GRID_THW]]).long()


def dummy_image(vision_config: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero pixels of the smallest image the tower takes (one merged token) and its ``[1, 3]`` grid."""
    import torch

    merge = int(vision_config.spatial_merge_size)
    channels = int(getattr(vision_config, "in_channels", getattr(vision_config, "in_chans", 3)))
    features = channels * int(vision_config.temporal_patch_size) * int(vision_config.patch_size) ** 2
    grid = torch.tensor([[1, merge, merge]], dtype=torch.int64, device=device)
    return torch.zeros(merge * merge, features, device=device), grid


class VisionForward:
    """Feeds a sharded vision-language model micro-batches with and without images (see the module docstring).

    ``kwargs`` is called once before each forward; it arms the dummy image for that forward when the
    micro-batch has none, and a pre-hook on the language model runs it.
    """

    def __init__(self, model: nn.Module, packing: bool = False) -> None:
        tower = vision_tower_path(model)
        language = _shortest_module_path(model, ("language_model",))
        if tower is None or language is None:
            raise ValueError(f"{type(model).__name__}: no vision tower / language model module found")
        self.model = model
        config: Any = model.config
        self.vision_config = config.vision_config
        self.tower_path = tower
        self.image_token_id = int(config.image_token_id)
        self._dummy_pending = False
        # The module that derives the 3D rotary positions (Qwen2.5-VL's ``model``): packed rows need it.
        self._rope: Any = next((m for m in model.modules() if callable(getattr(m, "get_rope_index", None))), None)
        if packing and self._rope is None:
            raise ValueError(
                f"policy.sequence_packing.enabled: {type(model).__name__} has no get_rope_index, so a packed row's "
                "image positions cannot be computed; set policy.sequence_packing.enabled=false"
            )
        model.get_submodule(language).register_forward_pre_hook(self._run_dummy, with_kwargs=True)

    def kwargs(self, input_ids: torch.Tensor, mb: Mapping[str, Any]) -> dict[str, Any]:
        """:func:`image_inputs` of the forward; arms the dummy image when the micro-batch has none."""
        self._dummy_pending = not has_images(mb)
        return image_inputs(mb, input_ids, self.image_token_id)

    def packed_position_ids(self, mb: Mapping[str, Any], text_positions: torch.Tensor) -> torch.Tensor:
        """``[4, 1, W]`` position ids of ``mb`` packed into one row of width ``W`` (its valid tokens back to back in
        row order, then padding; ``text_positions`` ``[1, W]`` restart at 0 per sequence): row 0 the text
        positions, rows 1-3 each sequence's 3D rotary positions as the model derives them for it alone (see the
        module docstring); the padding's are its text positions."""
        import torch

        ids, lengths = mb["input_ids"], mb["input_lengths"].long().to(mb["input_ids"].device)
        valid = torch.arange(ids.shape[1], device=ids.device)[None, :] < lengths[:, None]
        rows = lengths > 0  # get_rope_index cannot take an empty row
        with torch.no_grad():
            rope, _ = self._rope.get_rope_index(
                input_ids=ids[rows],
                mm_token_type_ids=(ids[rows] == self.image_token_id).int(),
                image_grid_thw=_grids(mb).to(ids.device) if has_images(mb) else None,
                attention_mask=valid[rows].long(),
            )
        used = rope[:, valid[rows]]  # [3, packed tokens], row-major: the packed order
        positions = text_positions.expand(3, -1).clone()
        positions[:, : used.shape[1]] = used.to(positions.device)
        return torch.cat([text_positions, positions])[:, None, :]

    def _run_dummy(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if not self._dummy_pending:
            return None
        self._dummy_pending = False
        embeds = kwargs.get("inputs_embeds")
        if embeds is None:
            return None
        pixels, grid = dummy_image(self.vision_config, embeds.device)
        out = self.model.get_submodule(self.tower_path)(pixels, grid_thw=grid)
        features = getattr(out, "pooler_output", None)
        features = out[0] if features is None else features
        kwargs["inputs_embeds"] = embeds + 0.0 * features.sum().to(embeds.dtype)
        return args, kwargs


__all__ = [
    "IMAGE_GRID_THW",
    "PIXEL_VALUES",
    "VisionForward",
    "check_unsupported",
    "dummy_image",
    "freeze_vision_tower",
    "has_images",
    "image_inputs",
    "is_vision_language",
    "model_class",
    "under",
    "vision_tower_path",
]
