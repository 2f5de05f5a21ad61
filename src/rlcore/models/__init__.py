"""Models rlcore builds locally, without any download: the built-in names and the model builders.

- :mod:`rlcore.models.builtin`: the names ``rlcore run`` accepts as a model
  (``tiny-llama``, ``tiny-qwen2``, ``tiny-qwen3`` and the presets) and their
  resolution to a local directory;
- :mod:`rlcore.models.presets`: ``qwen2.5-0.5b``, ``qwen3-0.6b``,
  ``llama-3.2-1b``: the real models' shapes and parameter counts, random weights;
- :mod:`rlcore.models.tokenizer`: the byte-level tokenizer of the built-in models;
- :mod:`rlcore.models.build`: a randomly initialised causal LM from a config;
- :mod:`rlcore.models.vlm`: a randomly initialised Qwen2.5-VL (``tiny-qwen2.5-vl``,
  ``qwen2.5-vl-3b``) with its tokenizer and image processor;
- :mod:`rlcore.models.cache`: the on-disk cache, each model built at most once;
- :mod:`rlcore.models.config_json`: any model's ``config.json`` (a directory or the hub cache) as a dict, and
  whether it is a vision-language model's.

The test kit's ``models`` module re-exports the builders beside its random
batches; production code imports them from here. torch and transformers are
imported inside the functions, so importing this package stays light.
"""

from rlcore.models.build import ARCHS, BUILD_VERSION, build_tiny_model, model_config
from rlcore.models.builtin import BUILTIN_MODELS, resolve_builtin_models, resolve_builtin_policy, resolve_model
from rlcore.models.cache import default_cache_root, tiny_model_path
from rlcore.models.config_json import has_vision_config, read_config_json
from rlcore.models.presets import PARAMETER_COUNTS, PRESETS, VLM_PRESETS, preset
from rlcore.models.tokenizer import (
    BYTE_OFFSET,
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    build_tiny_tokenizer,
)
from rlcore.models.vlm import (
    VISION_TOKENS,
    VLM_ARCH,
    build_tiny_vlm,
    build_tiny_vlm_tokenizer,
    load_vlm_processor,
    vlm_config,
)

__all__ = [
    "ARCHS",
    "BUILD_VERSION",
    "BUILTIN_MODELS",
    "BYTE_OFFSET",
    "CHAT_TEMPLATE",
    "PARAMETER_COUNTS",
    "PRESETS",
    "SPECIAL_TOKENS",
    "VISION_TOKENS",
    "VLM_ARCH",
    "VLM_PRESETS",
    "build_tiny_model",
    "build_tiny_tokenizer",
    "build_tiny_vlm",
    "build_tiny_vlm_tokenizer",
    "default_cache_root",
    "has_vision_config",
    "load_vlm_processor",
    "model_config",
    "preset",
    "read_config_json",
    "resolve_builtin_models",
    "resolve_builtin_policy",
    "resolve_model",
    "tiny_model_path",
    "vlm_config",
]
