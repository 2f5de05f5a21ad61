"""SFT samples as training batches: each message log tokenized message by message, the loss mask on the
assistant's tokens.

A message's tokens are what the chat template adds when the message is
appended: the log rendered up to and including it, minus the rendering of the
log before it (NeMo-RL's per-message formatting). So the template's headers
and separators belong to the message they introduce, and only an assistant
message's tokens (with the EOS that ends the sample, ``sft.add_eos``) carry
loss. A row without a message log trains its ``data.output_key`` answer as the
assistant's reply to its prompt.

A sample longer than ``policy.max_total_sequence_length`` is cut to it and its
``sample_mask`` is 0 (NeMo-RL's ``loss_multiplier``): it stays in the batch so
the batch keeps its size, and trains nothing; the step reports how many.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rlcore.datasets.files import DataError

if TYPE_CHECKING:
    from rlcore.data import BatchedDataDict
    from rlcore.datasets import Sample


def conversation(sample: "Sample") -> list[dict[str, str]]:
    """The sample's message log with the assistant's answer: as written, or its prompt plus ``ground_truth``."""
    messages = list(sample.messages)
    if not any(m["role"] == "assistant" for m in messages) and "ground_truth" in sample.metadata:
        messages.append({"role": "assistant", "content": str(sample.metadata["ground_truth"])})
    return messages


def answer_problem(sample: "Sample", where: str) -> str | None:
    """Why ``sample`` has nothing to train on (None when it has an assistant message)."""
    if any(m["role"] == "assistant" for m in conversation(sample)):
        return None
    return (f"{where}: row {sample.idx + 1} has no assistant message to train on: give it a message log with an "
            "assistant turn (data.messages_key) or an answer (data.output_key)")


def encode_conversation(tokenizer: Any, messages: list[dict[str, str]], sft: Any,
                        template_kwargs: dict[str, Any] | None = None,
                        trained: list[bool] | None = None) -> tuple[list[int], list[int]]:
    """``(token ids, loss mask)`` of one message log; the mask is 1 on the tokens the loss trains: the
    assistant's messages, or the messages ``trained`` marks (DPO: the response, not earlier turns). ``sft``:
    the section whose ``add_bos``, ``add_eos``, ``add_generation_prompt`` (and ``only_unmask_final``) apply."""
    trained = trained if trained is not None else [m["role"] == "assistant" for m in messages]
    if getattr(sft, "only_unmask_final", False) and any(trained):
        last = max(i for i, t in enumerate(trained) if t)
        trained = [i == last for i in range(len(messages))]
    kwargs = dict(template_kwargs or {})
    ids: list[int] = []
    mask: list[int] = []
    before = ""
    for i, message in enumerate(messages):
        prompt = sft.add_generation_prompt and message["role"] == "user"
        text = tokenizer.apply_chat_template(messages[:i + 1], tokenize=False, add_generation_prompt=prompt,
                                             **kwargs)
        if not text.startswith(before):
            raise DataError("policy.tokenizer.chat_template: rendering a message log does not extend the rendering "
                            f"of the messages before message {i + 1}, so its tokens cannot be told apart; use a "
                            "template that renders each message after the previous ones")
        chunk = tokenizer.encode(text[len(before):], add_special_tokens=False)
        ids += chunk
        mask += [int(trained[i])] * len(chunk)
        before = text
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    if sft.add_bos and bos is not None and ids[:1] != [bos]:
        ids, mask = [bos, *ids], [0, *mask]
    if sft.add_eos and eos is not None and ids[-1:] != [eos]:
        ids, mask = [*ids, eos], [*mask, int(trained[-1])]
    return ids, mask


def sft_batch(samples: list["Sample"], tokenizer: Any, cfg: Any, size: int | None = None) -> "BatchedDataDict":
    """The training batch of ``samples``: right-padded ``input_ids``, ``input_lengths``, ``token_mask`` (the
    assistant's tokens) and ``sample_mask`` (0 for a sample cut at ``policy.max_total_sequence_length``, and
    for the masked rows that fill the batch up to ``size``)."""
    from rlcore.run.prompts import pad_id

    limit = cfg.policy.max_total_sequence_length
    for sample in samples:  # a generator's samples meet this check here, a file's when the data was loaded
        if problem := answer_problem(sample, "data.train"):
            raise DataError(problem)
    encoded = [encode_conversation(tokenizer, conversation(s), cfg.sft, cfg.policy.tokenizer.chat_template_kwargs)
               for s in samples]
    keep = [len(ids) <= limit for ids, _ in encoded]
    rows = [(ids[:limit], mask[:limit]) for ids, mask in encoded]
    size = size or len(rows)
    rows += [rows[-1]] * (size - len(rows))  # filler rows, masked out below
    keep += [False] * (size - len(keep))
    return padded_batch(rows, keep, pad_id(tokenizer))


def padded_batch(rows: list[tuple[list[int], list[int]]], keep: list[bool], pad: int) -> "BatchedDataDict":
    """Right-padded ``input_ids``, ``input_lengths``, ``token_mask`` and ``sample_mask`` of ``(ids, mask)`` rows."""
    import torch

    from rlcore.data import BatchedDataDict

    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    token_mask = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, (ids, mask) in enumerate(rows):
        input_ids[i, :len(ids)] = torch.tensor(ids)
        token_mask[i, :len(mask)] = torch.tensor(mask, dtype=torch.float32)
    return BatchedDataDict(input_ids=input_ids,
                           input_lengths=torch.tensor([len(ids) for ids, _ in rows], dtype=torch.long),
                           token_mask=token_mask, sample_mask=torch.tensor(keep, dtype=torch.float32))
