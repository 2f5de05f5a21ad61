"""Registers the ``dtensor`` training backend (light: imports no torch)."""

from rlcore.plugins import BackendSpec, hookimpl

CAPABILITIES = frozenset({
    "train", "logprobs", "topk_logits", "reference_model", "dynamic_batching", "sequence_packing",
    "checkpoint", "tensor_parallel", "sequence_parallel", "refit", "lora",
})


@hookimpl
def rlcore_register_backends(register):
    register(BackendSpec(
        name="dtensor",
        kind="training",
        worker_class="rl_dtensor.worker:DTensorPolicyWorker",
        # The settings live in the core's own ``policy.dtensor_cfg`` section.
        config_class="rlcore.config.policy:DTensorConfig",
        capabilities=CAPABILITIES,
        requires=("torch", "transformers"),
        install_hint="pip install rl-dtensor",
        description="FSDP2 data parallel + DTensor tensor/sequence parallel (Llama, Qwen2, Qwen3).",
    ))
