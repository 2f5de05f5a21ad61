"""Vision-language models in the training backends (capability ``image_inputs``, docs/vision.md).

- :func:`is_vision_language` / :func:`model_class`: a config with a ``vision_config`` is loaded with
  ``AutoModelForImageTextToText``, every other one with ``AutoModelForCausalLM``.
- :func:`vision_tower_path` / :func:`freeze_vision_tower`: the tower's module (``model.visual`` in
  Qwen2.5-VL) and ``policy.freeze_vision_tower``.
- :class:`VisionForward`: the model kwargs of a micro-batch with images (its rows' ``pixel_values`` and
  ``image_grid_thw`` concatenated in row order, ``mm_token_type_ids`` so Qwen2.5-VL derives its 3D rotary
  positions, no ``position_ids``), and the dummy image that keeps sharded ranks in step.

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


def check_unsupported(config: PretrainedConfig, refused: Mapping[str, bool]) -> None:
    """Refuse a vision-language model with any setting in ``refused`` (config key -> whether it is on)."""
    if not is_vision_language(config):
        return
    for key, on in refused.items():
        if on:
            raise ValueError(
                f"{key}: not supported with the vision-language model {type(config).__name__} on this backend "
                f"(docs/vision.md); switch {key} off"
            )


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
        device = input_ids.device
        out[PIXEL_VALUES] = torch.cat(list(mb[PIXEL_VALUES])).to(device)
        out[IMAGE_GRID_THW] = torch.cat([g.reshape(-1, 3) for g in mb[IMAGE_GRID_THW]]).long().to(device)
    return out


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

    def __init__(self, model: nn.Module) -> None:
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
        model.get_submodule(language).register_forward_pre_hook(self._run_dummy, with_kwargs=True)

    def kwargs(self, input_ids: torch.Tensor, mb: Mapping[str, Any]) -> dict[str, Any]:
        """:func:`image_inputs` of the forward; arms the dummy image when the micro-batch has none."""
        self._dummy_pending = not has_images(mb)
        return image_inputs(mb, input_ids, self.image_token_id)

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
