"""``Capability``: the closed set of features a backend can declare.

A spec's ``capabilities`` are members of this enum; a name outside it is
refused when the plugin registers (one line, with the closest name), so a typo
cannot turn a feature silently off. The core and the kit test membership with
the members themselves (``Capability.SEQUENCE_PACKING in spec.capabilities``),
never with free strings. The members are ``str`` values, so a plugin may still
write ``capabilities={"train", "logprobs"}``.

A capability is how a backend opts in to behaviour: the core asks for what a
backend declares and never for more. Some capabilities need worker methods
(:data:`CAPABILITY_METHODS`; the Protocols of ``rlcore.interfaces.workers``
spell their signatures); the others change what existing calls do
(``docs/plugin-api.md`` has the table).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from enum import Enum


class Capability(str, Enum):
    """A feature a backend declares. Training backends use the first group, generation backends the second."""

    # training backends
    TRAIN = "train"
    LOGPROBS = "logprobs"
    TOPK_LOGITS = "topk_logits"
    REFERENCE_MODEL = "reference_model"
    DYNAMIC_BATCHING = "dynamic_batching"
    SEQUENCE_PACKING = "sequence_packing"
    CHECKPOINT = "checkpoint"
    TENSOR_PARALLEL = "tensor_parallel"
    SEQUENCE_PARALLEL = "sequence_parallel"
    PIPELINE_PARALLEL = "pipeline_parallel"
    REFIT = "refit"
    LORA = "lora"
    GENERATE = "generate"
    CHUNKED_LOGPROBS = "chunked_logprobs"  # honours policy.logprob_chunk_size (since rlcore 0.2)
    LOGITS_AT_INDICES = "logits_at_indices"  # a loss's input: logits at given token ids (since rlcore 0.2)
    LOGPROBS_AT_INDICES = "logprobs_at_indices"  # a loss's input: full-vocabulary logprobs at ids (since rlcore 0.2)
    ENTROPY = "entropy"  # a loss's input: the full-vocabulary entropy per position (since rlcore 0.2)
    # builds a value model (a scalar head on the language model) when its worker is given ``model_head='value'``
    # (since rlcore 0.3)
    VALUE_HEAD = "value_head"
    # trains on / generates for image-text batches: ``pixel_values``, ``image_grid_thw`` (and ``images`` for
    # generation) per row, docs/vision.md (since rlcore 0.3)
    IMAGE_INPUTS = "image_inputs"
    # generation backends
    DATA_PARALLEL = "data_parallel"
    STOP_STRINGS = "stop_strings"
    PARTIAL_REFIT = "partial_refit"
    LORA_ADAPTER = "lora_adapter"
    ASYNC_GENERATION = "async_generation"
    VERIFIED_REFIT = "verified_refit"  # reports weight_version + fingerprints after a refit (since rlcore 0.2)
    # requests served continuously: pause/resume in the three modes, ``as_completed`` (since rlcore 0.3)
    ASYNC_ENGINE = "async_engine"
    # a refit may land while requests run; outputs carry ``generation_weight_versions`` (since rlcore 0.3)
    IN_FLIGHT_WEIGHT_UPDATES = "in_flight_weight_updates"

    def __str__(self) -> str:
        return self.value


#: The methods a training backend's worker must have when its spec declares the capability (the Protocols of
#: ``rlcore.interfaces.workers`` hold their signatures; a test keeps the two equal).
CAPABILITY_METHODS: dict[Capability, tuple[str, ...]] = {
    Capability.TOPK_LOGITS: ("get_topk_logits",),
    Capability.REFIT: (
        "prepare_refit_info",
        "stream_weights_via_ipc_zmq",
        "init_collective",
        "broadcast_weights_for_collective",
    ),
    Capability.LORA: (
        "prepare_refit_info",
        "stream_weights_via_ipc_zmq",
        "broadcast_weights_for_collective",
        "save_lora_adapter",
    ),
    Capability.GENERATE: ("generate",),
    Capability.VALUE_HEAD: ("get_values",),
}


def parse_capabilities(values: Iterable[object]) -> frozenset[Capability]:
    """``values`` (members or their names) as members; ``ValueError`` naming every unknown one."""
    if isinstance(values, (str, bytes)):
        raise ValueError(f"capabilities is a set of names, got the string {values!r}")
    known = [c.value for c in Capability]
    out: set[Capability] = set()
    unknown: list[str] = []
    for value in values:
        try:
            out.add(Capability(value))
        except ValueError:
            close = difflib.get_close_matches(str(value), known, n=1)
            unknown.append(f"'{value}'" + (f" (did you mean '{close[0]}'?)" if close else ""))
    if unknown:
        raise ValueError(f"unknown capability {', '.join(unknown)}; known: {', '.join(known)}")
    return frozenset(out)
