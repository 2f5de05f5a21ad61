"""A randomly initialised Qwen2.5-VL (vision tower + text decoder) with its processor files, built locally.

The tokenizer is the tiny byte-level one plus the vision special tokens
(:data:`VISION_TOKENS`, ids right after the byte tokens); the model config's
``image_token_id`` and friends are those ids. The image processor is
transformers' Qwen2-VL one (PIL backend, no torchvision needed) at a small
``max_pixels``. torch and transformers are imported inside the functions.

transformers 5 cannot construct ``Qwen2_5_VLProcessor`` without torchvision
(its video processor needs it), so :func:`load_vlm_processor` falls back to
an image-only processor of the same class where torchvision is missing.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlcore.models.build import resolve_dtype, round_up, save_model
from rlcore.models.tokenizer import build_tiny_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast, ProcessorMixin, Qwen2_5_VLConfig

#: The only architecture :func:`build_tiny_vlm` builds (the ``arch`` the model cache routes on).
VLM_ARCH = "qwen2_5_vl"

#: Bump when the way VLMs are built changes, so cached builds are not reused.
VLM_BUILD_VERSION = 1

#: Qwen2.5-VL's vision special tokens, in id order after the byte tokens (259, 260, ...).
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")

#: The tiny chat format (``<|role|>`` headers), with ``content`` a string or a list of image/video/text parts.
VLM_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def build_tiny_vlm_tokenizer() -> PreTrainedTokenizerFast:
    """The byte-level tokenizer plus :data:`VISION_TOKENS` as special tokens, with :data:`VLM_CHAT_TEMPLATE`."""
    tokenizer = build_tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    return tokenizer


def build_tiny_vlm(
    save_dir: str | os.PathLike,
    arch: str = VLM_ARCH,
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 256,
    vocab_size: int | None = None,
    tie_word_embeddings: bool = False,
    max_position_embeddings: int = 4096,
    rope_theta: float = 1_000_000.0,
    mrope_section: Sequence[int] = (4, 6, 6),
    rms_norm_eps: float = 1e-6,
    vision_depth: int = 2,
    vision_hidden_size: int = 64,
    vision_num_heads: int = 2,
    vision_intermediate_size: int = 128,
    patch_size: int = 14,
    spatial_merge_size: int = 2,
    temporal_patch_size: int = 2,
    window_size: int = 112,
    fullatt_block_indexes: Sequence[int] = (1,),
    tokens_per_second: int = 2,
    min_pixels: int = 56 * 56,
    max_pixels: int = 224 * 224,
    initializer_range: float = 0.02,
    seed: int = 0,
    dtype: Any = "float32",
) -> str:
    """Build a random ``Qwen2_5_VLForConditionalGeneration`` and save it with tokenizer and image processor.

    The text decoder's head dim is ``hidden_size // num_heads`` and
    ``mrope_section`` (temporal, height, width rotary frequencies) must sum to
    half of it. The vision tower maps ``patch_size``-pixel patches (two frames
    deep for images: ``temporal_patch_size``) through ``vision_depth`` blocks,
    windowed except ``fullatt_block_indexes``, and merges each
    ``spatial_merge_size`` x ``spatial_merge_size`` group into one
    ``hidden_size`` token: a 56x56 image is 4x4 patches, 4 tokens. Images are
    resized to between ``min_pixels`` and ``max_pixels``. ``vocab_size``
    defaults to the tokenizer rounded up to a multiple of 64. Weights are drawn
    under ``seed`` in a forked RNG. ``AutoModelForImageTextToText`` loads the
    directory; :func:`load_vlm_processor` its processor. Returns the path.
    """
    args = _config_arguments(locals())  # first: only the arguments are local yet
    import torch
    from transformers import AutoModelForImageTextToText
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = build_tiny_vlm_tokenizer()
    config = _make_vlm_config(tokenizer, **args)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config, dtype=resolve_dtype(dtype))
    save_dir = Path(save_model(model, tokenizer, save_dir))
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        patch_size=patch_size,
        temporal_patch_size=temporal_patch_size,
        merge_size=spatial_merge_size,
    )
    image_processor.save_pretrained(str(save_dir))
    _write_video_processor_config(save_dir, image_processor.to_dict())
    return str(save_dir)


def _write_video_processor_config(save_dir: Path, image_processor: dict[str, Any]) -> None:
    """``video_preprocessor_config.json``, for ``AutoProcessor`` where torchvision is installed.

    Written as JSON because the video processor class cannot be instantiated
    without torchvision; it matches the image processor's patching and sizes.
    """
    import json

    keys = ("patch_size", "temporal_patch_size", "merge_size", "size", "image_mean", "image_std")
    config = {"video_processor_type": "Qwen2VLVideoProcessor", **{key: image_processor[key] for key in keys}}
    (save_dir / "video_preprocessor_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def vlm_config(**kwargs: Any) -> Qwen2_5_VLConfig:
    """The config ``build_tiny_vlm(dir, **kwargs)`` would save; nothing is built (e.g. for meta-device counts)."""
    bound = inspect.signature(build_tiny_vlm).bind("<dir>", **kwargs)
    bound.apply_defaults()
    return _make_vlm_config(build_tiny_vlm_tokenizer(), **_config_arguments(bound.arguments))


def load_vlm_processor(path: str | os.PathLike) -> ProcessorMixin:
    """The ``Qwen2_5_VLProcessor`` of a built VLM: ``AutoProcessor`` with torchvision, image-only without it."""
    import importlib.util

    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    if importlib.util.find_spec("torchvision") is not None:
        return AutoProcessor.from_pretrained(str(path))
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    processor_cls = _image_only_processor_class()
    return processor_cls(
        image_processor=AutoImageProcessor.from_pretrained(str(path)),
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
    )


def _image_only_processor_class() -> type[ProcessorMixin]:
    """``Qwen2_5_VLProcessor`` without the video processor slot (transformers requires torchvision for it)."""
    from transformers import BaseImageProcessor, PreTrainedTokenizerBase, ProcessorMixin, Qwen2_5_VLProcessor

    class ImageOnlyQwen2_5_VLProcessor(Qwen2_5_VLProcessor):
        def __init__(
            self,
            image_processor: BaseImageProcessor,
            tokenizer: PreTrainedTokenizerBase,
            chat_template: str | None = None,
        ):
            self.image_token = VISION_TOKENS[3]
            self.video_token = VISION_TOKENS[4]
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    return ImageOnlyQwen2_5_VLProcessor


def _config_arguments(arguments: dict[str, Any]) -> dict[str, Any]:
    """The build arguments that shape the config (everything but where, how and with what seed it is saved)."""
    skipped = {"save_dir", "seed", "dtype", "min_pixels", "max_pixels"}
    return {name: value for name, value in arguments.items() if name not in skipped}


def _make_vlm_config(
    tokenizer: PreTrainedTokenizerFast,
    *,
    arch: str,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    vocab_size: int | None,
    tie_word_embeddings: bool,
    max_position_embeddings: int,
    rope_theta: float,
    mrope_section: Sequence[int],
    rms_norm_eps: float,
    vision_depth: int,
    vision_hidden_size: int,
    vision_num_heads: int,
    vision_intermediate_size: int,
    patch_size: int,
    spatial_merge_size: int,
    temporal_patch_size: int,
    window_size: int,
    fullatt_block_indexes: Sequence[int],
    tokens_per_second: int,
    initializer_range: float,
) -> Qwen2_5_VLConfig:
    """Validate the shape and make the ``Qwen2_5_VLConfig``."""
    from transformers import Qwen2_5_VLConfig

    if arch != VLM_ARCH:
        raise ValueError(f"unknown VLM arch {arch!r}; build_tiny_vlm builds only {VLM_ARCH!r}")
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError(
            f"hidden_size ({hidden_size}) must be a multiple of num_heads ({num_heads}), "
            f"and num_heads of num_kv_heads ({num_kv_heads})"
        )
    head_dim = hidden_size // num_heads
    if head_dim < 32:
        raise ValueError(f"hidden_size // num_heads must be >= 32 (vLLM needs it), got {head_dim}")
    if sum(mrope_section) * 2 != head_dim:
        raise ValueError(f"mrope_section {list(mrope_section)} must sum to head_dim / 2 = {head_dim // 2}")
    if vision_hidden_size % vision_num_heads:
        raise ValueError(
            f"vision_hidden_size ({vision_hidden_size}) must be a multiple of vision_num_heads ({vision_num_heads})"
        )
    if any(not 0 <= i < vision_depth for i in fullatt_block_indexes):
        raise ValueError(f"fullatt_block_indexes {list(fullatt_block_indexes)} must lie in [0, {vision_depth})")
    if vocab_size is None:
        vocab_size = round_up(len(tokenizer), 64)
    if vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer ({len(tokenizer)})")

    vocab = tokenizer.get_vocab()
    token_ids = {token: vocab[token] for token in VISION_TOKENS}
    special_ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    text_config = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=rms_norm_eps,
        initializer_range=initializer_range,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta, "mrope_section": list(mrope_section)},
        pad_token_id=tokenizer.pad_token_id,
        **special_ids,
    )
    vision_config = dict(
        depth=vision_depth,
        hidden_size=vision_hidden_size,
        intermediate_size=vision_intermediate_size,
        num_heads=vision_num_heads,
        patch_size=patch_size,
        spatial_merge_size=spatial_merge_size,
        temporal_patch_size=temporal_patch_size,
        window_size=window_size,
        out_hidden_size=hidden_size,
        fullatt_block_indexes=list(fullatt_block_indexes),
        tokens_per_second=tokens_per_second,
        initializer_range=initializer_range,
    )
    return Qwen2_5_VLConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=token_ids["<|image_pad|>"],
        video_token_id=token_ids["<|video_pad|>"],
        vision_start_token_id=token_ids["<|vision_start|>"],
        vision_end_token_id=token_ids["<|vision_end|>"],
        tie_word_embeddings=tie_word_embeddings,
    )
