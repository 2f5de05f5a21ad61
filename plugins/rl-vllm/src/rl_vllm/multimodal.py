"""What an engine needs to serve an image-text model (Qwen2.5-VL): its prompts, its engine arguments, a CPU shim.

Prompt ids reach the engine and the trainer in two forms. The chat template writes ONE ``<|image_pad|>`` per
image; the Hugging Face processor repeats it once per merged patch (the expanded ids, what the trainer's
forward sees). vLLM's own multimodal processor does that expansion, so the engine must get the template's
ids: given already expanded ids it expands the first pad of each image again and the prompt is silently
wrong. ``output.prompt_token_ids`` of a request is the expanded prompt, the same ids as the processor's.

Not wired into the worker yet. torch, PIL, transformers and vLLM are imported inside the functions.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, TypedDict, TypeVar

if TYPE_CHECKING:
    from PIL.Image import Image

#: The placeholder the chat template writes once per image (vLLM expands it).
IMAGE_PAD_TOKEN = "<|image_pad|>"

T = TypeVar("T")


class _PromptIds(TypedDict):
    prompt_token_ids: list[int]


class ImagePrompt(_PromptIds, total=False):
    """The fields of vLLM's ``TokensPrompt`` an image prompt fills.

    vLLM's own type marks its optional keys with ``typing.NotRequired``, which mypy at the project's
    ``python_version = 3.10`` does not know: it would require them all.
    """

    multi_modal_data: dict[str, list[Image]]


def engine_prompt(prompt_ids: Sequence[int], images: Sequence[Image], image_token_id: int) -> ImagePrompt:
    """vLLM's prompt for chat-template ids with one ``image_token_id`` per image and those images, in order.

    Refuses ids the processor already expanded (a run of image tokens) and a count of placeholders that is
    not the number of images: vLLM would either expand again or fail deep inside its processor.
    """
    ids = [int(token) for token in prompt_ids]
    placeholders = [i for i, token in enumerate(ids) if token == image_token_id]
    if any(b == a + 1 for a, b in zip(placeholders, placeholders[1:])):
        raise ValueError(
            f"prompt_ids hold a run of image tokens ({image_token_id}): they look expanded by the HF processor; "
            "give the chat template's ids, one image token per image (vLLM expands them itself)"
        )
    if len(placeholders) != len(images):
        raise ValueError(
            f"prompt_ids hold {len(placeholders)} image tokens ({image_token_id}) for {len(images)} images: "
            "give one image token per image, in the order of the images"
        )
    prompt: ImagePrompt = {"prompt_token_ids": ids}
    if images:
        prompt["multi_modal_data"] = {"image": list(images)}
    return prompt


def image_engine_kwargs(max_images_per_prompt: int) -> dict[str, dict[str, int]]:
    """``LLM`` arguments of an image-only engine: at most ``max_images_per_prompt`` images and no video.

    ``video: 0`` makes vLLM refuse a video up front: serving one would need the video processor, which
    needs torchvision (the engine starts either way; measured with vLLM 0.32 on CPU).
    """
    if max_images_per_prompt < 1:
        raise ValueError(f"max_images_per_prompt must be >= 1, got {max_images_per_prompt}")
    return {"limit_mm_per_prompt": {"image": max_images_per_prompt, "video": 0}}


@contextmanager
def qwen2_vl_without_torchvision() -> Iterator[None]:
    """Let a CPU engine in this process load Qwen2-VL / Qwen2.5-VL where torchvision is missing; undone on exit.

    Keep the engine's whole life inside the block. Where torchvision is installed this does nothing.
    Without it, vLLM 0.32 with transformers 5 fails in three places, each patched here:

    - ``vllm.model_executor.models.qwen2_vl`` imports ``smart_resize`` from transformers'
      ``image_processing_qwen2_vl``, which imports torchvision: a stand-in module gives the PIL
      processor's ``smart_resize`` (the same function) and class;
    - vLLM inspects the model class in a child Python process (to keep CUDA out of the parent), which would
      not see that stand-in: the inspection runs in this process instead (harmless on a CPU host);
    - ``Qwen2_5_VLProcessor.from_pretrained`` builds the video processor, which needs torchvision: it gives
      rlcore's image-only processor, with a ``video_processor`` that only names the video kwargs (vLLM reads
      them; with ``video: 0`` it never runs one).
    """
    if importlib.util.find_spec("torchvision") is not None:
        yield
        return
    from transformers import Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil
    from vllm.model_executor.models import registry

    stub_name = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
    stub = types.ModuleType(stub_name, "Stand-in without torchvision (rl_vllm.multimodal).")
    stub.smart_resize = pil.smart_resize  # type: ignore[attr-defined]
    stub.Qwen2VLImageProcessor = pil.Qwen2VLImageProcessorPil  # type: ignore[attr-defined]
    saved_module = sys.modules.get(stub_name)
    saved_inspect = registry._run_in_subprocess
    own_from_pretrained = Qwen2_5_VLProcessor.__dict__.get("from_pretrained")  # else inherited
    sys.modules[stub_name] = stub
    registry._run_in_subprocess = _run_here
    Qwen2_5_VLProcessor.from_pretrained = classmethod(_image_only_processor)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        if own_from_pretrained is None:
            del Qwen2_5_VLProcessor.from_pretrained
        else:
            Qwen2_5_VLProcessor.from_pretrained = own_from_pretrained  # type: ignore[method-assign]
        registry._run_in_subprocess = saved_inspect
        if saved_module is None:
            sys.modules.pop(stub_name, None)
        else:
            sys.modules[stub_name] = saved_module


def _run_here(fn: Callable[[], T]) -> T:
    """vLLM's ``_run_in_subprocess``, run in this process."""
    return fn()


def _image_only_processor(cls: type, path: str, *args: object, **kwargs: object) -> object:
    """rlcore's image-only ``Qwen2_5_VLProcessor`` of ``path`` (vLLM's loading kwargs name nothing it needs)."""
    from transformers.processing_utils import VideosKwargs

    from rlcore.models import load_vlm_processor

    processor = load_vlm_processor(path)
    processor.video_processor = types.SimpleNamespace(valid_kwargs=VideosKwargs)
    return processor
