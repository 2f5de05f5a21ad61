"""Declares the ``megatron`` training backend to rlcore (light: imports no torch or megatron)."""

from rlcore.plugins import BackendSpec, Capability, hookimpl

MEGATRON_SPEC = BackendSpec(
    name="megatron",
    kind="training",
    worker_class="rl_megatron.worker:MegatronPolicyWorker",
    config_class="rl_megatron.config:MegatronConfig",  # policy.megatron_cfg
    layout="rl_megatron.layout:parallel_layout",
    config_check="rl_megatron.config:config_check",
    capabilities={
        Capability.TRAIN,
        Capability.LOGPROBS,
        Capability.TOPK_LOGITS,
        Capability.REFERENCE_MODEL,
        Capability.CHECKPOINT,
        Capability.TENSOR_PARALLEL,
        Capability.SEQUENCE_PARALLEL,
        Capability.PIPELINE_PARALLEL,
        Capability.REFIT,
        Capability.CHUNKED_LOGPROBS,
        Capability.LOGITS_AT_INDICES,
        Capability.LOGPROBS_AT_INDICES,
        Capability.ENTROPY,
        Capability.VALUE_HEAD,  # model_head="value": rl_megatron.value_worker
    },
    requires=("torch", "megatron.core", "transformers"),
    install_hint="pip install rl-megatron",
    description=(
        "megatron-core GPTModel: tensor, pipeline and data parallel; Megatron DDP and optimizer; value models."
    ),
)


@hookimpl
def rlcore_register_backends(register):
    register(MEGATRON_SPEC)
