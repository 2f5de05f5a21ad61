"""The short in-process training runs the tests start, in one place.

A run whose test is about the loop, the data, the loss, metrics, checkpoints or errors trains and generates on
one fsdp1 worker (``ONE_WORKER``): one process to start instead of two policy workers beside two vLLM engines,
about a quarter of the time on the 2-core CI machine. Runs whose subject is the engine or the refit into it keep
vLLM (``short_run_config`` alone): tests/algorithms/test_grpo.py's short run, async GRPO, multinode, the CLI lifecycle.
"""

from __future__ import annotations

#: Overrides for one fsdp1 worker that trains and generates itself (no engines, no refit).
ONE_WORKER = {"policy.backend": "fsdp1", "policy.generation.backend": "fsdp1", "cluster.workers_per_node": "1"}


def generation_backend() -> str:
    """vLLM when its plugin loaded, else fsdp1 (what examples/grpo_tiny.yaml itself falls back to)."""
    from rlcore.plugins import get_registry

    statuses = {r.name: r.status for r in get_registry().records}
    return "vllm" if statuses.get("vllm") == "ok" else "fsdp1"


def short_run_config(tmp_path, steps: int, **extra: str):
    """examples/grpo_tiny.yaml for ``steps`` steps into ``tmp_path``, with vLLM engines when installed;
    ``**ONE_WORKER`` among ``extra`` for a run without engines (later overrides win)."""
    from rlcore.config import load_config

    gen = generation_backend()
    overrides = [
        f"policy.backend={'reference' if gen == 'vllm' else 'fsdp1'}",
        f"policy.generation.backend={gen}",
        f"grpo.max_num_steps={steps}",
        f"logger.output_dir={tmp_path}",
        "logger.progress_bar=false",
        "checkpointing.save_every_n_steps=2",
        *(f"{k}={v}" for k, v in extra.items()),
    ]
    return load_config("examples/grpo_tiny.yaml", overrides)
