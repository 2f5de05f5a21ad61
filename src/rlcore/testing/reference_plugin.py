"""Registers the reference backend through the same public hook third parties use."""

from rlcore.plugins import BackendSpec, hookimpl


@hookimpl
def rlcore_register_backends(register):
    register(BackendSpec(
        name="reference",
        kind="training",
        worker_class="rlcore.testing.reference_worker:ReferenceWorker",
        capabilities={"train", "logprobs", "topk_logits", "reference_model", "dynamic_batching", "checkpoint", "refit"},
        requires=("torch", "transformers"),
        install_hint="pip install 'rlcore[runtime,hf]'",
        description="Plain torch data parallel; the conformance kit's reference implementation.",
    ))
