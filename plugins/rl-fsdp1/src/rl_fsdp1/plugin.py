"""Registers the ``fsdp1`` training backend (light: imports neither torch nor transformers).

The config selects it with ``policy.backend: fsdp1``, or implicitly when no
``policy.<backend>_cfg`` section is enabled (see ``PolicyConfig.training_backend``).
"""

from rlcore.plugins import BackendSpec, Capability, hookimpl

CAPABILITIES = frozenset(
    {
        Capability.TRAIN,
        Capability.LOGPROBS,
        Capability.TOPK_LOGITS,
        Capability.REFERENCE_MODEL,
        Capability.DYNAMIC_BATCHING,
        Capability.CHECKPOINT,
        Capability.GENERATE,
        Capability.REFIT,
        Capability.LORA,
        Capability.CHUNKED_LOGPROBS,
        Capability.LOGITS_AT_INDICES,
        Capability.LOGPROBS_AT_INDICES,
        Capability.ENTROPY,
        Capability.IMAGE_INPUTS,  # vision-language models: pixel_values / image_grid_thw rows (docs/vision.md)
    }
)


@hookimpl
def rlcore_register_backends(register):
    register(
        BackendSpec(
            name="fsdp1",
            kind="training",
            worker_class="rl_fsdp1.worker:FSDP1PolicyWorker",
            config_check="rl_fsdp1.checks:config_check",  # what a vision-language model cannot use
            capabilities=CAPABILITIES,
            requires=("torch", "transformers"),
            install_hint="pip install rl-fsdp1 (needs torch>=2.6 and transformers)",
            description="torch FSDP1 data parallel training with Hugging Face generate.",
        )
    )
