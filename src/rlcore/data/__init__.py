"""Batch container, dynamic batching and sequence packing.

Light on import: torch is imported inside the functions that need it.
"""

from rlcore.data.batched_data_dict import BatchedDataDict, invert_permutation
from rlcore.data.dynamic_batching import (
    MicroBatchPlan,
    balanced_assignment,
    plan_dynamic_microbatches,
    round_up,
)
from rlcore.data.packing import (
    PackedSequences,
    pack_microbatch,
    pack_sequences,
    packed_next_token_logprobs,
    unpack_tokens,
)

__all__ = [
    "BatchedDataDict",
    "MicroBatchPlan",
    "PackedSequences",
    "balanced_assignment",
    "invert_permutation",
    "pack_microbatch",
    "pack_sequences",
    "packed_next_token_logprobs",
    "plan_dynamic_microbatches",
    "round_up",
    "unpack_tokens",
]
