"""Declares the ``megatron`` training backend to rlcore (light: imports no torch or megatron)."""

from rlcore.plugins import BackendSpec, hookimpl

MEGATRON_SPEC = BackendSpec(
    name="megatron",
    kind="training",
    worker_class="rl_megatron.worker:MegatronPolicyWorker",
    capabilities={"train", "logprobs", "topk_logits", "reference_model", "checkpoint",
                  "tensor_parallel", "pipeline_parallel", "refit"},
    requires=("torch", "megatron.core", "transformers"),
    install_hint="pip install rl-megatron",
    description="megatron-core GPTModel: tensor, pipeline and data parallel; Megatron DDP and optimizer.",
)


@hookimpl
def rlcore_register_backends(register):
    register(MEGATRON_SPEC)
