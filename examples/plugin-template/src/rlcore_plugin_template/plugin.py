"""Declares the 'template' backend to rlcore.

rlcore imports this module (through the ``rlcore.plugins`` entry point) just to
*list* backends, e.g. for ``rlcore backends list``. Keep it light: no torch, no
ray, no engine. The worker and config classes are named as ``"module:Class"``
strings and imported only where they are used.
"""

from rlcore.plugins import BackendSpec, Capability, hookimpl


@hookimpl
def rlcore_register_backends(register):
    register(
        BackendSpec(
            name="template",
            kind="training",
            worker_class="rlcore_plugin_template.worker:TemplateWorker",
            config_class="rlcore_plugin_template.config:TemplateConfig",
            capabilities={
                Capability.TRAIN,
                Capability.LOGPROBS,
                Capability.REFERENCE_MODEL,
                Capability.CHECKPOINT,
                Capability.DYNAMIC_BATCHING,
            },
            requires=("torch", "transformers"),
            install_hint="pip install 'rlcore[runtime,hf]'",
            description="Plain data parallel with bucketed gradient all-reduce (the plugin template).",
        )
    )
