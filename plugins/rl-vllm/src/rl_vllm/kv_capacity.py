"""Whether a batch fits the engine's KV cache at once.

vLLM hands its KV cache out in blocks (32 tokens each on CPU: rl_vllm.worker.CPU_BLOCK_SIZE). A batch whose
sequences need more blocks than the cache holds still completes, but in waves:
the scheduler admits what fits and the rest wait (or get preempted and
recomputed), so generation takes a multiple of its time with no message. The
engine checks each batch against its cache and warns once, naming the setting.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class KvCapacity:
    """The engine's KV cache in blocks, and how many sequences it schedules at once."""

    num_blocks: int
    block_size: int
    max_num_seqs: int

    @classmethod
    def of(cls, llm: Any) -> KvCapacity:
        """Read from a started ``vllm.LLM`` (the block count is known once its cache is allocated)."""
        config = llm.llm_engine.vllm_config
        return cls(
            int(config.cache_config.num_gpu_blocks or 0),
            int(config.cache_config.block_size),
            int(config.scheduler_config.max_num_seqs),
        )

    def blocks_needed(self, prompt_lengths: Sequence[int], max_tokens: Sequence[int]) -> int:
        """Blocks for the sequences scheduled together, each grown to its prompt + max_tokens.

        At most ``max_num_seqs`` run at once (the scheduler's own limit, not a
        shortage): the largest that many are counted.
        """
        per_sequence = sorted(
            (math.ceil((p + m) / self.block_size) for p, m in zip(prompt_lengths, max_tokens)), reverse=True
        )
        return sum(per_sequence[: self.max_num_seqs])

    def shortfall(
        self, prompt_lengths: Sequence[int], max_tokens: Sequence[int], kv_cache_space_gb: float | None
    ) -> str | None:
        """Why this batch cannot run at once, with the fix; None when it fits."""
        needed = self.blocks_needed(prompt_lengths, max_tokens)
        if needed <= self.num_blocks or not self.num_blocks:
            return None
        if kv_cache_space_gb is not None:
            fix = (
                f"raise policy.generation.vllm_cfg.kv_cache_space_gb from {kv_cache_space_gb:g} to about "
                f"{kv_cache_space_gb * needed / self.num_blocks:.3g}"
            )
        else:
            fix = "raise policy.generation.vllm_cfg.gpu_memory_utilization"
        return (
            f"a batch of {len(prompt_lengths)} sequences needs up to {needed} KV-cache blocks of "
            f"{self.block_size} tokens (each prompt + max_new_tokens) but the cache holds {self.num_blocks}: "
            f"vLLM will generate it in waves, slower; {fix}, or spread the rollout over more engines"
        )
