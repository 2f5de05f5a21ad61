"""vLLM's ``/tokenize`` and ``/detokenize``, which agent harnesses (NeMo-Gym's) call to count and align tokens.

``/tokenize`` takes a ``prompt`` (text, encoded with the tokenizer's special tokens unless
``add_special_tokens: false``) or ``messages`` (through the run's chat template, with ``tools`` and the
generation prompt unless ``add_generation_prompt: false``): the ids are those ``chat/completions`` would give the
same conversation. It answers ``count``, ``max_model_len`` (the run's ``policy.max_total_sequence_length``),
``tokens`` and, with ``return_token_strs``, ``token_strs``. ``/detokenize`` takes ``tokens`` and answers ``prompt``.
A request may not bring chat-template arguments other than the run's: its ids would not be the rollout's.
"""

from __future__ import annotations

from typing import Any

from rlcore.serving.openai_api import ApiError, refuse_unknown, request_object

_TOKENIZE_FIELDS = {
    "model",
    "prompt",
    "messages",
    "tools",
    "add_special_tokens",
    "add_generation_prompt",
    "chat_template_kwargs",
    "return_token_strs",
}


def tokenize(body: Any, tokenizer: Any, model: str, max_len: int, template_kwargs: dict[str, Any] | None) -> Any:
    """The answer to a ``/tokenize`` body (:class:`ApiError` for what is not served)."""
    from rlcore.chat import templates

    body = _checked(body, model, _TOKENIZE_FIELDS)
    if ("prompt" in body) == ("messages" in body):
        raise ApiError(400, "give either prompt (text) or messages (a conversation), not both or neither")
    if body.get("chat_template_kwargs") not in (None, template_kwargs or {}, template_kwargs):
        raise ApiError(
            400,
            f"chat_template_kwargs: {body['chat_template_kwargs']!r} differs from the run's "
            f"({template_kwargs!r}), with which rollouts render their prompts; leave it out",
            "chat_template_kwargs",
        )
    if "prompt" in body:
        if not isinstance(body["prompt"], str):
            raise ApiError(400, "prompt: expected text", "prompt")
        ids = list(tokenizer(body["prompt"], add_special_tokens=_flag(body, "add_special_tokens", True))["input_ids"])
    else:
        from rlcore.serving.episodes import template_message

        messages = body["messages"]
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise ApiError(400, "messages: expected a list of {role, content} messages", "messages")
        tools = body.get("tools")
        rendered = templates.render(
            tokenizer,
            [template_message(m) for m in messages],
            _flag(body, "add_generation_prompt", True),
            tools,
            template_kwargs,
        )
        ids = templates.encode_rendered(tokenizer, rendered)
    strs = tokenizer.convert_ids_to_tokens(ids) if _flag(body, "return_token_strs", False) else None
    return {"count": len(ids), "max_model_len": max_len, "tokens": ids, "token_strs": strs}


def detokenize(body: Any, tokenizer: Any, model: str) -> dict[str, Any]:
    """The answer to a ``/detokenize`` body."""
    body = _checked(body, model, {"model", "tokens"})
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise ApiError(400, "tokens: expected a list of token ids", "tokens")
    if any(t < 0 or t >= len(tokenizer) for t in tokens):
        raise ApiError(400, f"tokens: ids must lie in [0, {len(tokenizer)})", "tokens")
    return {"prompt": tokenizer.decode(tokens)}


def _checked(body: Any, model: str, known: set[str]) -> dict[str, Any]:
    body = request_object(body, model)
    refuse_unknown(body, known)
    return body


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise ApiError(400, f"{name}: expected true or false", name)
    return value
