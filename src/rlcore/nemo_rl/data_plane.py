"""NeMo-RL's TransferQueue ``data_plane`` and the single-controller ``async_rl`` section that runs on it.

With ``data_plane.enabled`` NeMo-RL's ``run_grpo.py`` trains through ``grpo_train_sync``
(nemo_rl/algorithms/grpo_sync.py): the same synchronous loop as ``grpo_train``, its batches moved through
TransferQueue storage instead of Ray object refs, checked for parity against it by NeMo-RL. That changes no
number, so the section is ignored. ``async_rl`` configures another loop, ``run_grpo_single_controller.py``
(which requires the data plane): rollouts streamed up to ``async_rl.sampler.max_lookahead_versions`` weight
versions ahead of the trainer. rlcore does not have that loop, so a config meant for it is refused.
"""

from __future__ import annotations

from typing import Any

from rlcore.nemo_rl.conversion import Conversion, get

TRANSPORT = (
    "TransferQueue moves the same batches between the same steps (NeMo-RL's grpo_train_sync, parity-tested "
    "against grpo_train); rlcore passes them directly"
)


def data_plane(nemo: dict[str, Any], out: Conversion) -> None:
    """``data_plane`` ignored as transport; ``async_rl`` refused when it is the loop that runs, else ignored."""
    section = nemo.get("data_plane")
    enabled = isinstance(section, dict) and section.get("enabled") is True
    if "data_plane" in nemo:
        out.ignored.append(
            ("data_plane", TRANSPORT if enabled else "off: batches go from the driver to the workers directly")
        )
    if nemo.get("async_rl") not in (None, {}):
        if enabled:
            out.problems.append(
                "async_rl: is NeMo-RL's single-controller asynchronous loop (examples/run_grpo_single_controller.py, "
                "which needs data_plane.enabled: true): rollouts streamed up to async_rl.sampler."
                "max_lookahead_versions weight versions ahead of training; rlcore does not have that loop: remove "
                "the section (synchronous GRPO) or use rlcore's asynchronous GRPO, grpo.async_grpo.enabled with "
                "grpo.async_grpo.max_trajectory_age_steps"
            )
        else:
            out.ignored.append(
                (
                    "async_rl",
                    "read only by NeMo-RL's single-controller script, which refuses to start without "
                    "data_plane.enabled; run_grpo.py does not read it",
                )
            )
    if enabled and get(nemo, "grpo.async_grpo.enabled") is True:
        out.problems.append(
            "grpo.async_grpo.enabled: is true with data_plane.enabled: true, a pair NeMo-RL's run_grpo.py does not "
            "run (async GRPO with TransferQueue is its single-controller script's); set data_plane.enabled: false "
            "for rlcore's asynchronous GRPO"
        )


__all__ = ["TRANSPORT", "data_plane"]
