"""What an engine needs to serve an image-text model (Qwen2.5-VL): its prompts, its engine arguments, a CPU shim.

Prompt ids reach the engine and the trainer in two forms. The chat template writes ONE ``<|image_pad|>`` per
image; the Hugging Face processor repeats it once per merged patch (the expanded ids, what the trainer's
forward sees). vLLM's own multimodal processor does that expansion, so the engine must get the template's
ids: given already expanded ids it expands the first pad of each image again and the prompt is silently
wrong. ``output.prompt_token_ids`` of a request is the expanded prompt, the same ids as the processor's.

The worker (``rl_vllm.worker``) uses it: a batch's ``input_ids`` are the trainer's expanded ids (docs/vision.md);
:func:`engine_requests` collapses each run of image tokens back to one for the engine, and
:func:`check_engine_prompts` checks that vLLM expanded them into exactly those ids again. torch, PIL, transformers
and vLLM are imported inside the functions.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING, Any, TypedDict, TypeVar

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


def collapse_image_runs(ids: Sequence[int], image_token_id: int) -> list[int]:
    """``ids`` with each run of ``image_token_id`` (one image, expanded by the HF processor) cut to one token."""
    out: list[int] = []
    for token in ids:
        token = int(token)
        if token != image_token_id or not out or out[-1] != image_token_id:
            out.append(token)
    return out


def image_runs(ids: Sequence[int], image_token_id: int) -> int:
    """How many runs of ``image_token_id`` ``ids`` hold: its number of images."""
    return collapse_image_runs(ids, image_token_id).count(image_token_id)


def engine_requests(
    prompts: Sequence[Sequence[int]], images: Sequence[Sequence[Image]] | None, image_token_id: int | None
) -> list[ImagePrompt]:
    """vLLM's prompt of each expanded prompt (the trainer's ids) and its row's images (``None``: no images).

    A row with images gets its image runs collapsed (vLLM expands them again); a row without is sent as is.
    """
    requests: list[ImagePrompt] = []
    for row, prompt in enumerate(prompts):
        own = list(images[row]) if images is not None else []
        if not own:
            requests.append({"prompt_token_ids": [int(t) for t in prompt]})
            continue
        if image_token_id is None:
            raise ValueError(f"row {row} has images, but the engine serves a text model")
        requests.append(engine_prompt(collapse_image_runs(prompt, image_token_id), own, image_token_id))
    return requests


def check_engine_prompts(
    requests: Sequence[Mapping[str, Any]], expected: Sequence[Sequence[int]], got: Sequence[Any]
) -> None:
    """Raise unless vLLM's prompt of every image request (``got[i]``: its ``prompt_token_ids``) is the batch's
    expanded prompt ``expected[i]``: otherwise the engine saw other tokens than the trainer will score."""
    for row, (request, want, seen) in enumerate(zip(requests, expected, got)):
        if "multi_modal_data" not in request:
            continue
        seen_ids = [int(t) for t in (seen or [])]
        if seen_ids != [int(t) for t in want]:
            raise RuntimeError(
                f"row {row}: vLLM expanded the prompt's images into {len(seen_ids)} prompt tokens, the batch's "
                f"input_ids have {len(want)} (or other ids): the engine's image processor does not match the one "
                "that built the batch (same model directory, same min/max pixels?)"
            )


def image_batch_problems(data: Mapping[str, Any], image_token_id: int | None, model: str | None) -> list[str]:
    """What is wrong with the images of a generation batch for an engine of ``model`` (empty when fine).

    ``image_token_id``: the engine model's, None for a text model. Checked on the driver, before any engine
    sees the batch.
    """
    images = data.get("images")
    if images is None:
        return []
    rows = int(data["input_ids"].shape[0])
    if len(images) != rows:
        return [f"images has {len(images)} entries for a batch of {rows} (one list of images per row)"]
    counts = [len(own or []) for own in images]
    if not any(counts):
        return []
    if image_token_id is None:
        return [
            f"the batch has images, but the engine serves the text model {model} (its Hugging Face config has "
            "no vision_config): set policy.generation.model_name to a vision-language model"
        ]
    lengths = [int(n) for n in data["input_lengths"].tolist()]
    wrong = [
        (row, found, count)
        for row, (count, n) in enumerate(zip(counts, lengths))
        if (found := image_runs(data["input_ids"][row, :n].tolist(), image_token_id)) != count
    ]
    if wrong:
        return [
            f"rows' input_ids hold other numbers of image token runs ({image_token_id}) than they have images: "
            f"(row, runs, images) {wrong[:5]}"
        ]
    return []


def vision_image_token(model: str) -> int | None:
    """The image token id of ``model`` when its Hugging Face config has a ``vision_config``; None for a text model.

    The config is ``config.json`` as it lies in the directory or the hub cache; a hub id not in the cache goes
    through ``AutoConfig`` (which may download it). A config that cannot be read counts as a text model's: the
    engine then reports it, as it would without images.
    """
    config = _hf_config(model)
    if config.get("vision_config") is None:
        return None
    token = config.get("image_token_id", config.get("image_token_index"))
    if token is None:
        raise ValueError(f"{model} is a vision-language model whose config names no image_token_id")
    return int(token)


def _hf_config(model: str) -> dict[str, Any]:
    import os

    from rlcore.models import read_config_json

    config = read_config_json(model)
    if config is not None or os.path.isdir(model):
        return config or {}
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(model).to_dict()
    except Exception:  # noqa: BLE001 - unreadable: vLLM's own loading says why
        return {}


def multimodal_engine_kwargs(limits: Mapping[str, int] | None, vision: bool) -> dict[str, dict[str, int]]:
    """``LLM`` arguments for multimodal inputs: ``limits`` (``vllm_cfg.limit_mm_per_prompt``) as given, and for
    a vision-language model no video unless asked (rlcore's batches carry images only; see
    :func:`image_engine_kwargs`). A text model ignores them."""
    chosen = dict(limits or {})
    if vision:
        chosen.setdefault("video", 0)
    return {"limit_mm_per_prompt": chosen} if chosen else {}


def enter_vision_engine(
    model: str, limits: Mapping[str, int] | None, stack: ExitStack
) -> tuple[int | None, dict[str, dict[str, int]]]:
    """``(image token id or None, LLM arguments)`` of an engine of ``model``; for a vision-language model the CPU
    shim (:func:`qwen2_vl_without_torchvision`) is entered on ``stack``, to be closed when the engine is gone."""
    token = vision_image_token(model)
    if token is not None:
        stack.enter_context(qwen2_vl_without_torchvision())
    return token, multimodal_engine_kwargs(limits, token is not None)


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
