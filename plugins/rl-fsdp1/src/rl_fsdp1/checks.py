"""Settings the fsdp1 backend refuses before anything starts, each in one line (light: no torch)."""

from __future__ import annotations

from typing import Any


def config_check(request: Any) -> list[str]:
    """A ``rlcore.plugins.LayoutRequest``'s problems: LoRA on a vision-language model (the workers refuse it
    too)."""
    from rlcore.config.vision import vision_refusals

    lora = request.policy.lora.enabled
    return vision_refusals(request.policy, "fsdp1", {"policy.lora.enabled": (lora, "set it to false")})
