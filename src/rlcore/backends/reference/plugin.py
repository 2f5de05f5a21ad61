"""Registers the ``reference`` backend through the same public hook third parties use (light: no torch)."""

from rlcore.plugins import BackendSpec, Capability, hookimpl


@hookimpl
def rlcore_register_backends(register):
    register(
        BackendSpec(
            name="reference",
            kind="training",
            worker_class="rlcore.backends.reference.worker:ReferenceWorker",
            capabilities={
                Capability.TRAIN,
                Capability.LOGPROBS,
                Capability.TOPK_LOGITS,
                Capability.REFERENCE_MODEL,
                Capability.DYNAMIC_BATCHING,
                Capability.CHECKPOINT,
                Capability.REFIT,
                Capability.CHUNKED_LOGPROBS,
                Capability.LOGITS_AT_INDICES,
                Capability.LOGPROBS_AT_INDICES,
                Capability.ENTROPY,
            },
            requires=("torch", "transformers"),
            install_hint="pip install 'rlcore[runtime,hf]'",
            description="Plain torch data parallel: the smallest correct training backend.",
        )
    )
