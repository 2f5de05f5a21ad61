"""Whether a run's model sees images, and what a vision-language model needs of its backends (docs/vision.md).

Checked at resolution, before any process starts: a backend without the ``image_inputs`` capability would load
a vision-language model as a causal LM, or drop the images, and train something else than the config says.
"""

from __future__ import annotations

from typing import Any

from rlcore.config.backends import selection_path
from rlcore.models import has_vision_config
from rlcore.plugins import BackendSpec, Capability, Registry


def vision_problems(
    policy: Any, training: BackendSpec, generation: BackendSpec | None, registry: Registry
) -> list[str]:
    """A vision-language model on a backend that does not declare ``image_inputs``, and a vision setting given
    for a text model."""
    if not has_vision_config(str(policy.model_name)):
        if policy.freeze_vision_tower:
            return [
                f"policy.freeze_vision_tower: {policy.model_name} is a text model (its config has no "
                "vision_config): it has no vision tower to freeze; remove the setting"
            ]
        return []
    problems = []
    if policy.tokenizer.chat_template is None:
        problems.append(
            f"policy.tokenizer.chat_template: is null (the passthrough template: the prompt text as written, "
            f"with no image placeholder), and {policy.model_name} is a vision-language model; set it to 'default' "
            "(the model's own template) or to a template that renders image parts"
        )
    engine = generation if generation is not training else None  # a backend that generates itself: said once
    for path, spec in ((selection_path(policy), training), ("policy.generation.backend", engine)):
        if spec is None or spec.supports(Capability.IMAGE_INPUTS):
            continue
        able = sorted(
            r.name
            for r in registry.backends()
            if r.spec is not None and r.spec.kind == spec.kind and r.spec.supports(Capability.IMAGE_INPUTS)
        )
        problems.append(
            f"{path}: {policy.model_name} is a vision-language model, and the {spec.kind} backend '{spec.name}' "
            f"does not declare 'image_inputs' (it would drop the images); use one that does "
            f"({', '.join(able) or 'none installed'})"
        )
    return problems


def vision_refusals(policy: Any, backend: str, settings: dict[str, tuple[bool, str]]) -> list[str]:
    """For a backend's config check: the ``settings`` (dotted key -> (whether it is on, the fix)) that
    ``backend`` cannot train a vision-language model with, when the policy's model is one."""
    if not has_vision_config(str(policy.model_name)):
        return []
    return [refusal(key, str(policy.model_name), backend, fix) for key, (on, fix) in settings.items() if on]


def refusal(key: str, model: str, backend: str, fix: str) -> str:
    """The one line that refuses the setting ``key`` for the vision-language model ``model`` on ``backend`` (the
    config checks and the workers say the same)."""
    return f"{key}: {model} is a vision-language model, and the {backend} backend does not train one with it; {fix}"
