"""Registers the ``dtensor`` training backend (light: imports no torch)."""

from rlcore.plugins import BackendSpec, Capability, hookimpl

CAPABILITIES = frozenset(
    {
        Capability.TRAIN,
        Capability.LOGPROBS,
        Capability.TOPK_LOGITS,
        Capability.REFERENCE_MODEL,
        Capability.DYNAMIC_BATCHING,
        Capability.SEQUENCE_PACKING,
        Capability.CHECKPOINT,
        Capability.TENSOR_PARALLEL,
        Capability.SEQUENCE_PARALLEL,
        Capability.REFIT,
        Capability.LORA,
        Capability.CHUNKED_LOGPROBS,
        Capability.LOGITS_AT_INDICES,
        Capability.LOGPROBS_AT_INDICES,
        Capability.ENTROPY,
        Capability.IMAGE_INPUTS,  # vision-language models: pixel_values / image_grid_thw rows (docs/vision.md)
        Capability.VALUE_HEAD,  # model_head="value" (rlcore 0.3)
    }
)


@hookimpl
def rlcore_register_backends(register):
    register(
        BackendSpec(
            name="dtensor",
            kind="training",
            worker_class="rl_dtensor.worker:DTensorPolicyWorker",
            config_class="rl_dtensor.config:DTensorConfig",  # policy.dtensor_cfg
            layout="rl_dtensor.layout:parallel_layout",
            config_check="rl_dtensor.checks:config_check",  # what a vision-language model cannot use
            capabilities=CAPABILITIES,
            requires=("torch", "transformers"),
            install_hint="pip install rl-dtensor",
            description="FSDP2 data parallel + DTensor tensor/sequence parallel (Llama, Qwen2, Qwen3).",
        )
    )
