"""rlcore plugin entry point: declares the ``vllm`` generation backend.

Imported to list backends, so it imports nothing but rlcore's plugin module.
"""

from rlcore.plugins import BackendSpec, Capability, hookimpl


@hookimpl
def rlcore_register_backends(register):
    register(
        BackendSpec(
            name="vllm",
            kind="generation",
            worker_class="rl_vllm.worker:VllmGenerationWorker",
            driver_class="rl_vllm.generation:VllmGeneration",
            config_class="rl_vllm.config:VllmConfig",
            capabilities={
                Capability.GENERATE,
                Capability.REFIT,
                Capability.PARTIAL_REFIT,
                Capability.LORA_ADAPTER,
                Capability.ASYNC_GENERATION,
                Capability.DATA_PARALLEL,
                Capability.STOP_STRINGS,
                Capability.LOGPROBS,
                Capability.VERIFIED_REFIT,
                Capability.ASYNC_ENGINE,  # with vllm_cfg.async_engine: true (rl_vllm.engine_loop)
                Capability.IN_FLIGHT_WEIGHT_UPDATES,
                Capability.IMAGE_INPUTS,  # docs/vision.md: image batches of a vision-language model
            },
            requires=("vllm",),
            install_hint="pip install 'rl-vllm[cpu]'  (or [gpu] on CUDA)",
            checks="rl_vllm.checks:host_checks",  # the torch-family clash, the CPU's kernels
            import_check="vllm:LLM",  # `import vllm` is lazy: it works where `from vllm import LLM` dies
            description="vLLM engines in Ray actors (data parallel), in-place weight refit.",
        )
    )
