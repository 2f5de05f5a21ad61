"""Declares the 'tpexample' backend to rlcore (light: no torch, no ray).

Beside the plain template's spec, it names a layout function (the spec's
``layout`` field): rlcore then shards data by the layout this backend runs, not as pure data
parallel.
"""

from rlcore.plugins import BackendSpec, Capability, hookimpl


@hookimpl
def rlcore_register_backends(register):
    register(
        BackendSpec(
            name="tpexample",
            kind="training",
            worker_class="rlcore_plugin_tp.worker:TPWorker",
            config_class="rlcore_plugin_tp.config:TPExampleConfig",
            layout="rlcore_plugin_tp.layout:parallel_layout",
            capabilities={
                Capability.TRAIN,
                Capability.LOGPROBS,
                Capability.REFERENCE_MODEL,
                Capability.CHECKPOINT,
                Capability.TENSOR_PARALLEL,
            },
            requires=("torch", "transformers"),
            install_hint="pip install 'rlcore[runtime,hf]'",
            description="Hand-written tensor parallel (column/row split linears) plus data parallel.",
        )
    )
