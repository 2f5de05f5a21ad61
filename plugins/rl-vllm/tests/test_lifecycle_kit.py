"""rl-vllm with ``vllm_cfg.async_engine: true`` through the kit's engine lifecycle checks, on CPU.

One engine for the class (started once; the restart check, last and slow, starts a new one on the same
placement); two data-parallel engines doubled the start-up on two cores, and test_generation.py covers them.
The generation kit's own checks run on the same engine (output format, HF agreement, continuous
``generate_async``); the plugin probes are left to ``test_generation.py``. Weights are pushed by the
shared-memory transport straight from this process: the tiny model's own checkpoint, so every refit here is an
identity refit and every output must equal the unpaused one.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rl_vllm.generation import VllmGeneration
from rl_vllm.refit import EngineStaleError
from rlcore.testing.conformance import EngineLifecycleConformance, GenerationBackendConformance

BUCKET_BYTES = 1 << 20


class TestVllmLifecycle(GenerationBackendConformance, EngineLifecycleConformance):
    backend_name = "vllm"
    world_size = 1
    max_new_tokens = 240  # about 0.8 s a request on CPU: still running when the kit pauses, 0.15 s in
    stale_errors = (EngineStaleError,)
    lifecycle_timeout_s = 60.0
    lifecycle_settle_s = 0.15
    lifecycle_paused_probe_s = 0.3

    def generation_overrides(self) -> dict:
        return {"vllm_cfg": {"kv_cache_space_gb": 0.0625, "max_model_len": 256, "async_engine": True}}

    def make_generation(self, cluster: Any, config: Any) -> Any:
        return VllmGeneration(cluster, config, name_prefix="lifecycle-vllm")

    def refit(self, engine: Any, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """The shared-memory transport, from this process to every engine (as ``test_refit.py`` streams)."""
        import ray

        from rlcore.refit.buckets import metadata_of
        from rlcore.refit.shared_memory import stream_to_receiver

        info = metadata_of(state_dict.items())
        engine.prepare_refit_info(info)
        endpoints, receivers = engine.refit_endpoints(), engine.update_weights_via_ipc_zmq(BUCKET_BYTES)
        for rank in range(engine.num_engines):
            address, key = endpoints[rank]
            named = ((name, state_dict[name]) for name in info)
            stream_to_receiver(named, info, address, key, BUCKET_BYTES, torch.device("cpu"))
        ray.get(receivers, timeout=120)

    def test_plugin_module_is_light(self, kit_registry: Any) -> None:
        pytest.skip("checked once, by test_generation.py's TestVllmBackend")

    def test_spec_is_valid(self, backend_spec: Any) -> None:
        pytest.skip("checked once, by test_generation.py's TestVllmBackend")

    @pytest.mark.slow
    def test_lifecycle_restarted_engine_is_stale_until_refit(self, lifecycle: Any) -> None:
        """Slow: starting a second engine costs about 30 s on CPU."""
        super().test_lifecycle_restarted_engine_is_stale_until_refit(lifecycle)
