"""The value head of a megatron value model (``model_head='value'``, the critic of PPO).

The model is the language model's trunk with Hugging Face's token-classification head in place of the vocabulary
output layer: ``score = Linear(hidden_size, 1)`` with bias, on the final norm's output, exactly what
``AutoModelForTokenClassification`` with ``num_labels=1`` computes (its dropout off). On megatron it takes the
output layer's place on the last pipeline stage (:func:`install_value_head`), so the pipeline schedule, context
parallelism and the checkpoints treat it as they treat the output layer; it is replicated over tensor-parallel
ranks. Under sequence parallelism each rank scores its slice of the sequence and the ``[s, b, 1]`` values are
all-gathered (cheaper than gathering the hidden states); the head's weights are then marked ``sequence_parallel``,
so megatron's ``finalize_model_grads`` sums their gradients (each rank's covers its slice only) over the TP group.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)


class ValueHead(torch.nn.Module):
    """``Linear(hidden_size, 1)`` with bias, called as megatron calls its output layer: ``head(hidden [s, b, h],
    weight=None, runtime_gather_output=None)`` returns ``(values [s, b, 1], None)`` for the whole sequence."""

    def __init__(self, hidden_size: int, sequence_parallel: bool, tp_group: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype))
        self.sequence_parallel = sequence_parallel  # read by GPTModel in inference mode, as of its output layer
        self.tp_group = tp_group
        for param in self.parameters():
            param.sequence_parallel = sequence_parallel  # type: ignore[attr-defined]

    def forward(
        self, hidden_states: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output: Any = None
    ) -> tuple[torch.Tensor, None]:
        if weight is not None:
            raise ValueError("a value head has weights of its own (it is never tied to the word embeddings)")
        values = torch.nn.functional.linear(hidden_states, self.weight, self.bias)
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            # every TP rank computes the same loss of the gathered values: backward takes this rank's slice only
            values = gather_from_sequence_parallel_region(
                values, tensor_parallel_output_grad=False, group=self.tp_group
            )
        return values, None


def install_value_head(gpt: Any, config: Any) -> ValueHead | None:
    """Put a :class:`ValueHead` in place of ``gpt``'s vocabulary output layer (on the last pipeline stage; other
    stages have none). Its weights are zero until loaded or initialised (:func:`init_value_head`)."""
    if not getattr(gpt, "post_process", False):
        return None
    if gpt.share_embeddings_and_output_weights:
        raise ValueError("a value model's GPTModel must be built with untied output weights")
    from megatron.core import parallel_state

    tp_group = parallel_state.get_tensor_model_parallel_group()
    head = ValueHead(config.hidden_size, config.sequence_parallel, tp_group, config.params_dtype)
    gpt.output_layer = head.to(next(gpt.parameters()).device)
    return head


@torch.no_grad()
def init_value_head(head: ValueHead, initializer_range: float, seed: int) -> None:
    """Initialise the head as Hugging Face initialises a token-classification head: weight normal(0,
    ``initializer_range``), bias zero; from a generator seeded with ``seed`` alone, so every rank that holds the
    head (TP replicas, dp replicas) draws the same weights."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    weight = torch.empty(head.weight.shape, dtype=torch.float32).normal_(0.0, initializer_range, generator=generator)
    head.weight.copy_(weight)
    head.bias.zero_()


def value_head_names() -> dict[str, str]:
    """``{megatron name: HF name}`` of the head's tensors (the token-classification model's ``score``)."""
    return {"output_layer.weight": "score.weight", "output_layer.bias": "score.bias"}


def token_classification_architecture(causal_lm: str) -> str:
    """``Qwen2ForCausalLM`` → ``Qwen2ForTokenClassification`` (the class a saved value model loads as)."""
    return causal_lm.removesuffix("ForCausalLM") + "ForTokenClassification"


def causal_lm_architecture(name: str) -> str:
    """``Qwen2ForTokenClassification`` → ``Qwen2ForCausalLM``: the trunk's weight mapping is the causal LM's."""
    suffix = "ForTokenClassification"
    return name.removesuffix(suffix) + "ForCausalLM" if name.endswith(suffix) else name


__all__ = [
    "ValueHead",
    "causal_lm_architecture",
    "init_value_head",
    "install_value_head",
    "logger",
    "token_classification_architecture",
    "value_head_names",
]
