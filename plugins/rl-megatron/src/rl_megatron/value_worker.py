"""What a megatron worker built with ``model_head='value'`` (capability ``value_head``) does differently.

:class:`MegatronValueModel` is a mixin of :class:`rl_megatron.worker.MegatronPolicyWorker`. The model is the
trunk plus :class:`rl_megatron.value_head.ValueHead` on the last pipeline stage, so the pipeline schedule gives
the head's ``[b, s, 1]`` output where a language model's gives logits (context-parallel shards already gathered):
:meth:`_values_of` turns it into the ``[B, S]`` values of ``rlcore.training.value_head.aligned_values``, which
``get_values`` returns and ``train`` hands the loss in place of token logprobs.

Weights: the trunk loads from a causal-LM or a token-classification checkpoint; a checkpoint without ``score.*``
leaves the head to :func:`rl_megatron.value_head.init_value_head` (Hugging Face's initialisation under
``rlcore.training.value_head.VALUE_HEAD_SEED``, with an INFO line).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rl_megatron.value_head import init_value_head, logger, value_head_names
from rl_megatron.weights import hf_tensor_names, load_hf_into_stage
from rlcore.data import BatchedDataDict
from rlcore.training.value_head import ModelHead


class MegatronValueModel:
    """The value-model side of the megatron worker (see the module docstring)."""

    gpt: Any
    shape: Any
    hf_config: Any
    cfg: Any
    model: Any
    model_head: ModelHead
    stage_offsets: list[int]
    pp_rank: int
    tp_rank: int
    tp_size: int
    experts: Any
    _check_mode: Callable[[str], None]
    _token_pass: Callable[..., torch.Tensor]

    @property
    def is_value_model(self) -> bool:
        return self.model_head == "value"

    def _load_hf(self, path: str) -> None:
        """This rank's shards of the HF checkpoint at ``path``; a value model's head, when the checkpoint has
        none (a causal LM's), initialised as Hugging Face initialises a token-classification head."""
        fresh_head: frozenset[str] = frozenset()
        if self.is_value_model:
            names = value_head_names()
            if not set(names.values()) <= hf_tensor_names(path):
                fresh_head = frozenset(names)
        load_hf_into_stage(
            self.gpt,
            self.shape,
            path,
            self.stage_offsets[self.pp_rank],
            self.tp_rank,
            self.tp_size,
            self.experts.offset,
            skip=fresh_head,
        )
        if fresh_head:
            self._init_fresh_value_head(path)

    def _init_fresh_value_head(self, path: str) -> None:
        from rlcore.training.value_head import VALUE_HEAD_SEED, token_classification_class

        std = float(getattr(self.hf_config, "initializer_range", 0.02))
        head = self.gpt.output_layer if getattr(self.gpt, "post_process", False) else None
        if head is not None:
            init_value_head(head, std, VALUE_HEAD_SEED)
        if self.tp_rank == 0 and head is not None:
            logger.info(
                "value model: %s has no value head (score.weight, score.bias); initialised score as %s initialises "
                "it (normal(0, %s) weight, zero bias, seed %d); its lm_head is not used",
                path,
                token_classification_class(self.hf_config).__name__,
                std,
                VALUE_HEAD_SEED,
            )

    def _values_of(self, mb: BatchedDataDict, head_out: torch.Tensor) -> torch.Tensor:
        """``[B, S]`` float32 values (differentiable) at the caller's width ``S`` from the head's ``[B, W, 1]``
        output (``W`` is the micro-batch's own padded width, larger or smaller than ``S``)."""
        from rlcore.training.value_head import aligned_values

        width = mb["input_ids"].shape[1]
        values = aligned_values(head_out[:, :width], mb["input_lengths"])
        return torch.nn.functional.pad(values, (0, width - values.shape[1]))

    def get_values(
        self, data: BatchedDataDict, /, *, micro_batch_size: int | None = None, mode: str = "plain"
    ) -> BatchedDataDict:
        """``values``: ``[B, S]`` float32, aligned like logprobs (position ``i`` holds V(s_i), the head at the
        hidden state of position ``i - 1``; position 0 and padding 0). Collective."""
        if not self.is_value_model:
            raise RuntimeError("get_values: this worker is a language model; build it with model_head='value'")
        self._check_mode(mode)
        return BatchedDataDict(values=self._token_pass(data, micro_batch_size, self._values_of))


__all__ = ["MegatronValueModel"]
