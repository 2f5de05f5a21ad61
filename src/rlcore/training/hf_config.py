"""``policy.hf_config_overrides``: values set on the model's Hugging Face config before the model is built.

NeMo-RL's key of the same name: top-level keys replace the config's values
(``AutoConfig.from_pretrained(path, **overrides)``). Two kinds are refused, in
one line naming ``policy.hf_config_overrides.<key>``:

- a key the config class does not have (Hugging Face would keep it as an
  inert attribute: a typo, or a setting of another framework such as a
  capacity factor, would silently change nothing);
- a key that changes the shape of a parameter (hidden size, expert count,
  ...): the checkpoint's weights would not fit the model. Overrides that only
  change the numbers (``rms_norm_eps``, ``rope_parameters``,
  ``router_aux_loss_coef``, ``output_router_logits``) are applied.

The training backends build their model through :func:`pretrained_model` (or
:func:`load_config` when they build it themselves); the generation engine
applies the same mapping (vLLM's ``hf_overrides``), so both sides compute
with one config. Saved checkpoints carry the overridden config.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedModel

OVERRIDES_PATH = "policy.hf_config_overrides"


def load_config(path: str, overrides: Mapping[str, Any] | None = None) -> PretrainedConfig:
    """The model's config at ``path`` with ``overrides`` applied; raises ``ValueError`` naming a refused key."""
    from transformers import AutoConfig

    if not overrides:
        return AutoConfig.from_pretrained(path)
    config, unused = AutoConfig.from_pretrained(path, return_unused_kwargs=True, **dict(overrides))
    if unused:
        key = sorted(unused)[0]
        raise ValueError(
            f"{OVERRIDES_PATH}.{key}: {type(config).__name__} (the config of {path}) has no setting {key!r}, "
            f"so it would change nothing; remove it or use one of the config's keys (its config.json)"
        )
    _check_shapes_unchanged(path, config, overrides)
    return config


def _parameter_shapes(config: PretrainedConfig) -> dict[str, tuple[int, ...]]:
    import torch

    from rlcore.training.vision import model_class

    with torch.device("meta"):  # structure only: no memory, no initialisation cost worth counting
        model = model_class(config).from_config(config)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def _check_shapes_unchanged(path: str, config: PretrainedConfig, overrides: Mapping[str, Any]) -> None:
    from transformers import AutoConfig

    before = _parameter_shapes(AutoConfig.from_pretrained(path))
    after = _parameter_shapes(config)
    if before == after:
        return
    changed = sorted(set(before) ^ set(after)) or sorted(n for n in before if before[n] != after[n])
    keys = ", ".join(sorted(overrides))
    raise ValueError(
        f"{OVERRIDES_PATH}: setting {keys} changes the model's parameters ({changed[0]}: "
        f"{before.get(changed[0])} -> {after.get(changed[0])}), so the weights of {path} do not fit it; "
        f"override only keys that keep every parameter's shape (e.g. rms_norm_eps, rope_parameters)"
    )


def pretrained_model(
    path: str, overrides: Mapping[str, Any] | None = None, dtype: torch.dtype | None = None
) -> PreTrainedModel:
    """``AutoModelForCausalLM.from_pretrained(path)`` built with the overridden config
    (``AutoModelForImageTextToText`` for a vision-language model, :mod:`rlcore.training.vision`)."""
    from rlcore.training.vision import model_class

    config = load_config(path, overrides)
    return model_class(config).from_pretrained(path, config=config, dtype=dtype)


__all__ = ["OVERRIDES_PATH", "load_config", "pretrained_model"]
