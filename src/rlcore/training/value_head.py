"""Value models (capability ``value_head``): a language model's trunk with a scalar head, PPO's critic.

Backend-neutral pieces every training backend that declares ``value_head`` shares:

- :func:`aligned_values`: the head's per-position output in the logprob alignment of design.md §2.2 (position
  ``i`` holds V(s_i) = the head at the hidden state of position ``i - 1``; position 0 and padding 0), for a
  right-padded ``[B, S]`` forward or a packed ``[1, T]`` one;
- :func:`value_model_config` and :func:`load_value_model`: the weights are exactly Hugging Face's
  ``AutoModelForTokenClassification`` with one label (trunk + ``score = Linear(hidden, 1)`` with bias), so a
  checkpoint saves and loads in that format; a causal-LM checkpoint loads its trunk, drops ``lm_head`` and gets a
  freshly initialised head (as Hugging Face initialises that class, under a fixed seed); a one-label
  sequence-classification checkpoint (a hub reward model: ``score`` without bias) loads its head with a zero bias;
- :func:`value_step_hooks`: the step hooks of a value model, whose forward feeds the loss values instead of
  logprobs (``TrainingWorkerBase.train`` applies it).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, cast

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedModel

    from rlcore.data import BatchedDataDict
    from rlcore.data.packing import PackedSequences
    from rlcore.training.loop import StepHooks

log = logging.getLogger(__name__)

#: What a training worker builds: a causal LM (``"lm"``, every worker before rlcore 0.3) or a value model.
ModelHead = Literal["lm", "value"]
MODEL_HEADS: tuple[ModelHead, ...] = ("lm", "value")

#: The head's seed when it is initialised fresh (loading a causal-LM checkpoint): every rank and every run start
#: from the same head.
VALUE_HEAD_SEED = 0


class NoTokenDistributionError(RuntimeError):
    """A token-distribution method (logprobs, top-k, generation, refit) was called on a value model."""


def no_token_distribution(method: str) -> NoTokenDistributionError:
    """The error of calling ``method`` on a value model, in one line with the fix."""
    return NoTokenDistributionError(
        f"{method}: a value model has no token distribution (it was built with model_head='value'); call "
        "get_values on it, and logprobs, generation and refit on the policy's own (model_head='lm') Policy"
    )


def check_model_head(model_head: str) -> ModelHead:
    """``model_head`` as given to a worker, or ``ValueError`` naming the known ones."""
    if model_head not in MODEL_HEADS:
        raise ValueError(f"model_head={model_head!r}: expected one of {', '.join(map(repr, MODEL_HEADS))}")
    return model_head


def aligned_values(
    head_out: torch.Tensor, input_lengths: torch.Tensor, packed: PackedSequences | None = None
) -> torch.Tensor:
    """``[B, S]`` float32 values in the logprob alignment from the head's per-position output.

    ``head_out`` is ``[B, S, 1]`` or ``[B, S]`` for a right-padded forward of the caller's width ``S``, or
    ``[1, T, 1]`` / ``[1, T]`` / ``[T]`` for a forward over ``packed`` (:func:`rlcore.data.packing.pack_microbatch`;
    ``T`` may exceed the packing's own width, e.g. sequence-parallel padding, which is ignored). Differentiable.
    Position ``i`` of a sequence holds the head's output at its position ``i - 1``; position 0 and positions at or
    past its length are 0.
    """
    import torch

    from rlcore.training.logprobs import align

    if head_out.dim() == 3:
        head_out = head_out[..., 0]
    if packed is None:
        return align(head_out[:, :-1].float(), input_lengths)
    from rlcore.data.packing import unpack_tokens

    flat_out = head_out.reshape(-1).float()
    width = int(packed.cu_seqlens[-1])
    flat = torch.zeros(width, dtype=torch.float32, device=flat_out.device)
    flat[1:] = flat_out[: width - 1]
    starts = packed.position_ids.reshape(-1)[:width].to(flat.device) == 0  # no in-sequence context: 0
    flat = torch.where(starts, torch.zeros_like(flat), flat)
    return unpack_tokens(flat, packed.cu_seqlens, packed.batch_size, packed.seq_len, packed.input_lengths)


def token_classification_class(config: PretrainedConfig) -> type[PreTrainedModel]:
    """Hugging Face's token-classification class of ``config``'s architecture (``Qwen2ForTokenClassification``)."""
    from transformers import AutoModelForTokenClassification

    mapping = AutoModelForTokenClassification._model_mapping
    if type(config) not in mapping:
        raise ValueError(
            f"model_type {config.model_type!r} has no Hugging Face token-classification class, so it cannot be a "
            "value model (a scalar head on the trunk); use an architecture AutoModelForTokenClassification knows"
        )
    return cast("type[PreTrainedModel]", mapping[type(config)])


def value_model_config(config: PretrainedConfig) -> PretrainedConfig:
    """``config`` (a causal LM's or a value model's, changed in place and returned) as a value model's: one label,
    no dropout before the head (training must be a pure function of the weights), the token-classification
    architecture recorded for ``from_pretrained``."""
    kind = _classification_kind(config)
    if getattr(config, "num_labels", 1) != 1 and kind is not None:
        raise ValueError(
            f"the checkpoint is a {kind} model with {config.num_labels} labels; a value model has "
            "one (num_labels=1): start from a causal LM or a one-label checkpoint"
        )
    config.num_labels = 1
    config.classifier_dropout = 0.0
    config.architectures = [token_classification_class(config).__name__]
    return config


def _classification_kind(config: PretrainedConfig) -> str | None:
    """``"token-classification"`` or ``"sequence-classification"`` when ``config``'s architecture is one, else None."""
    for arch in getattr(config, "architectures", None) or ():
        for suffix, kind in (
            ("ForTokenClassification", "token-classification"),
            ("ForSequenceClassification", "sequence-classification"),
        ):
            if str(arch).endswith(suffix):
                return kind
    return None


def load_value_model(path: str, config: PretrainedConfig, seed: int = VALUE_HEAD_SEED) -> PreTrainedModel:
    """The float32 value model of the checkpoint at ``path`` with ``config`` (:func:`value_model_config`), on CPU.

    A token-classification checkpoint with one label loads whole. A one-label sequence-classification checkpoint
    (Hugging Face's reward models: the same ``score`` weight, without bias) loads whole with a zero bias, so each
    position's output is that model's score had the sequence ended there. A causal-LM checkpoint loads its trunk,
    drops ``lm_head``, and the head is initialised as Hugging Face initialises the class (weight normal(0,
    ``initializer_range``), bias 0) from ``seed``, leaving torch's generator as it was; an INFO line says so.
    """
    import torch

    cls = token_classification_class(config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        loaded = cls.from_pretrained(path, config=config, dtype=torch.float32, output_loading_info=True)
    model, info = cast("tuple[PreTrainedModel, dict[str, list[str]]]", loaded)
    fresh = sorted(k for k in info["missing_keys"] if k.startswith("score."))
    if other := sorted(set(info["missing_keys"]) - set(fresh)):
        raise ValueError(f"{path}: the checkpoint lacks {', '.join(other[:3])} of the value model's trunk")
    if fresh == ["score.bias"]:  # a sequence-classification head: its weight loaded, it has no bias
        with torch.no_grad():
            cast("torch.nn.Linear", model.get_submodule("score")).bias.zero_()
        log.info("value model: %s has a score head without bias (sequence classification); its bias is 0", path)
    elif fresh:
        log.info(
            "value model: %s has no value head (%s); initialised score as %s initialises it "
            "(normal(0, %s) weight, zero bias, seed %d); its lm_head is not used",
            path,
            ", ".join(fresh),
            cls.__name__,
            getattr(config, "initializer_range", "?"),
            seed,
        )
    return model


def value_step_hooks(
    hooks: StepHooks, forward_values: Callable[[BatchedDataDict[Any]], torch.Tensor], loss_inputs: tuple[str, ...]
) -> StepHooks:
    """A value model's step hooks: ``forward`` yields the values (``[B, S]``, differentiable, aligned like logprobs)
    that the loss gets where a language model's gets token logprobs; the rest of the step is the same machinery.
    A loss asking for inputs beyond them (logits at indices, entropy, ...) is refused."""
    if loss_inputs:
        raise no_token_distribution(f"a loss asking for {', '.join(loss_inputs)}")
    return dataclasses.replace(hooks, forward=forward_values, forward_with_inputs=None)
