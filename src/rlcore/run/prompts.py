"""Where prompts are built: the chat template, and the length budget of prompt + completion.

``policy.tokenizer.chat_template`` follows NeMo-RL's ``get_tokenizer``:
``None`` installs a passthrough template (a message is its content, so the
prompt reaches the model as the task wrote it), ``'default'`` keeps the
tokenizer's own, a path ending in ``.jinja`` is read from that file, any
other string is the template. Each sample's message log is rendered with the
generation prompt.

``policy.max_total_sequence_length`` bounds prompt + completion: a prompt
that leaves no room is an error, and completions are cut so that the
sequence fits (as vLLM's ``max_model_len`` does for NeMo-RL), marked
``truncated``.

``data.max_input_seq_length`` (NeMo-RL's): a prompt of at least that many
tokens is no error but is cut to its first few tokens (NeMo-RL's
``math_hf_data_processor``: a one-message log keeps ``min(4, limit)``), still
generated from and scored, and its samples are masked out of the loss
(``prompt_cut``, which :func:`rlcore.run.step.training_batch` turns into
``sample_mask`` 0).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlcore.config.errors import ConfigError

#: NeMo-RL's passthrough template: the concatenated message contents.
PASSTHROUGH_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def configure_tokenizer(tokenizer: Any, tokenizer_cfg: Any) -> Any:
    """Install ``policy.tokenizer.chat_template`` on ``tokenizer`` (in place; returned for chaining)."""
    template = tokenizer_cfg.chat_template
    path = "policy.tokenizer.chat_template"
    if template is None:
        tokenizer.chat_template = PASSTHROUGH_TEMPLATE
    elif template.strip().lower() == "default":
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(
                [
                    f"{path}: is 'default' but the tokenizer {tokenizer_cfg.name!r} has no chat template "
                    "of its own: set it to null (the prompt text as is) or to a Jinja template"
                ]
            )
    elif template.endswith(".jinja"):
        try:
            tokenizer.chat_template = Path(template).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError([f"{path}: cannot read {template}: {exc.strerror or exc}"]) from None
    else:
        tokenizer.chat_template = template
    return tokenizer


def load_tokenizer(cfg: Any) -> Any:
    """The run's tokenizer (``policy.tokenizer``), with its chat template installed."""
    from transformers import AutoTokenizer

    return configure_tokenizer(AutoTokenizer.from_pretrained(cfg.policy.tokenizer.name), cfg.policy.tokenizer)


def render_prompts(
    tokenizer: Any,
    message_logs: list[list[dict[str, Any]]],
    template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> list[str]:
    """Each message log through the tokenizer's chat template, with the generation prompt; ``tools`` (OpenAI
    function schemas) go to the template as ``tools=`` when given."""
    kwargs = dict(template_kwargs or {})
    if tools is not None:
        kwargs["tools"] = tools
    return [
        tokenizer.apply_chat_template(log, tokenize=False, add_generation_prompt=True, **kwargs) for log in message_logs
    ]


def pad_id(tokenizer: Any) -> int:
    """The id that pads prompts and cut completions (0 for a tokenizer without a pad token)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0


def cut_long_prompts(ids: list[list[int]], max_input: int | None) -> tuple[list[list[int]], list[bool]]:
    """``(ids, cut)``: each prompt of at least ``max_input`` tokens (``data.max_input_seq_length``) cut as NeMo-RL
    cuts its one-message prompt, and which were; ``None`` cuts nothing."""
    from rlcore.config.data import cut_tokens_per_message

    if max_input is None:
        return ids, [False] * len(ids)
    keep = cut_tokens_per_message(max_input, 1)
    cut = [len(seq) >= max_input for seq in ids]
    return [seq[:keep] if long else seq for seq, long in zip(ids, cut)], cut


def check_prompt_room(prompt_lengths: Any, max_total: int) -> None:
    """A prompt must leave room for at least one generated token within ``max_total``."""
    longest = int(prompt_lengths.max()) if len(prompt_lengths) else 0
    if longest >= max_total:
        raise ValueError(
            f"a prompt of {longest} tokens leaves no room for a completion within "
            f"policy.max_total_sequence_length={max_total}; raise it or shorten the prompts"
        )


def clip_rollout(rollout: Any, prompt_lengths: Any, max_total: int, pad_id: int) -> Any:
    """Cut completions so prompt + completion <= ``max_total`` (rollouts already within it are untouched)."""
    import torch

    ends = rollout["unpadded_sequence_lengths"]
    if int(ends.max()) <= max_total and rollout["output_ids"].shape[1] <= max_total:
        return rollout
    gen = torch.minimum(rollout["generation_lengths"], (max_total - prompt_lengths).clamp_min(0))
    cut = gen < rollout["generation_lengths"]
    ends = prompt_lengths + gen
    width = min(rollout["output_ids"].shape[1], max_total)
    positions = torch.arange(width)[None, :]
    past = positions >= ends[:, None]
    rollout["output_ids"] = rollout["output_ids"][:, :width].masked_fill(past, pad_id)
    rollout["logprobs"] = rollout["logprobs"][:, :width].masked_fill(past, 0.0)
    rollout["generation_lengths"] = gen
    rollout["unpadded_sequence_lengths"] = ends
    if "truncated" in rollout:
        rollout["truncated"] = rollout["truncated"] | cut
    return rollout


__all__ = [
    "PASSTHROUGH_TEMPLATE",
    "check_prompt_room",
    "clip_rollout",
    "configure_tokenizer",
    "cut_long_prompts",
    "load_tokenizer",
    "pad_id",
    "render_prompts",
]
