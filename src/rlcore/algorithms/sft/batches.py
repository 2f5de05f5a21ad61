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
the batch keeps its size, and trains nothing; the step reports how many. With
``data.max_input_seq_length`` (NeMo-RL's ``sft_processor``), a sample of at
least that many tokens is masked instead, each of its messages cut to
``min(4, limit // messages)`` tokens as NeMo-RL cuts it (:class:`LengthRule`). A
step in which no sample trains a token stops the run (:func:`nothing_trained`
says why), and so does a file whose samples are all cut, before anything starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlcore.datasets.files import DataError

if TYPE_CHECKING:
    from rlcore.data import BatchedDataDict
    from rlcore.datasets import Sample
    from rlcore.run.image_prompts import ImageModel


def conversation(sample: Sample) -> list[dict[str, str]]:
    """The sample's message log with the assistant's answer: as written, or its prompt plus ``ground_truth``."""
    messages = list(sample.messages)
    if not any(m["role"] == "assistant" for m in messages) and "ground_truth" in sample.metadata:
        messages.append({"role": "assistant", "content": str(sample.metadata["ground_truth"])})
    return messages


def answer_problem(sample: Sample, where: str) -> str | None:
    """Why ``sample`` has nothing to train on (None when it has an assistant message)."""
    if any(m["role"] == "assistant" for m in conversation(sample)):
        return None
    return (
        f"{where}: row {sample.idx + 1} has no assistant message to train on: give it a message log with an "
        "assistant turn (data.messages_key) or an answer (data.output_key)"
    )


#: One message's ``(token ids, loss mask)``.
Chunk = tuple[list[int], list[int]]


def encode_messages(
    tokenizer: Any,
    messages: list[dict[str, str]],
    sft: Any,
    template_kwargs: dict[str, Any] | None = None,
    trained: list[bool] | None = None,
) -> list[Chunk]:
    """``(token ids, loss mask)`` of each message of a log (the BOS in the first's, the EOS in the last's, as
    NeMo-RL's formatted message log has them); see :func:`encode_conversation`."""
    trained = trained if trained is not None else [m["role"] == "assistant" for m in messages]
    if getattr(sft, "only_unmask_final", False) and any(trained):
        last = max(i for i, t in enumerate(trained) if t)
        trained = [i == last for i in range(len(messages))]
    kwargs = dict(template_kwargs or {})
    chunks: list[Chunk] = []
    before = ""
    for i, message in enumerate(messages):
        prompt = sft.add_generation_prompt and message["role"] == "user"
        text = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False, add_generation_prompt=prompt, **kwargs)
        if not text.startswith(before):
            raise DataError(
                "policy.tokenizer.chat_template: rendering a message log does not extend the rendering "
                f"of the messages before message {i + 1}, so its tokens cannot be told apart; use a "
                "template that renders each message after the previous ones"
            )
        chunk = tokenizer.encode(text[len(before) :], add_special_tokens=False)
        chunks.append((chunk, [int(trained[i])] * len(chunk)))
        before = text
    ids = [token for chunk, _ in chunks for token in chunk]
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    if sft.add_bos and bos is not None and ids[:1] != [bos]:
        first, first_mask = chunks[0]
        chunks[0] = ([bos, *first], [0, *first_mask])
    if sft.add_eos and eos is not None and ids[-1:] != [eos]:
        last_ids, last_mask = chunks[-1]
        chunks[-1] = ([*last_ids, eos], [*last_mask, int(trained[-1])])
    return chunks


def encode_conversation(
    tokenizer: Any,
    messages: list[dict[str, str]],
    sft: Any,
    template_kwargs: dict[str, Any] | None = None,
    trained: list[bool] | None = None,
) -> tuple[list[int], list[int]]:
    """``(token ids, loss mask)`` of one message log; the mask is 1 on the tokens the loss trains: the
    assistant's messages, or the messages ``trained`` marks (DPO: the response, not earlier turns). ``sft``:
    the section whose ``add_bos``, ``add_eos``, ``add_generation_prompt`` (and ``only_unmask_final``) apply."""
    return joined(encode_messages(tokenizer, messages, sft, template_kwargs, trained))


def joined(chunks: list[Chunk]) -> Chunk:
    """The messages' chunks as one sequence."""
    return [t for ids, _ in chunks for t in ids], [m for _, mask in chunks for m in mask]


@dataclass(frozen=True)
class LengthRule:
    """Which samples are cut and masked out of the loss, and how they are cut.

    Without ``data.max_input_seq_length``: one longer than ``policy.max_total_sequence_length``, cut to it. With
    it, NeMo-RL's processors: SFT masks a sample of at least that many tokens (``sft_processor``), DPO a pair
    with a sequence longer than it (``preference_preprocessor``), and each message keeps
    ``min(4, limit // messages)`` tokens.
    """

    limit: int
    setting: str  # the dotted path that sets the limit
    masks_equal: bool  # a sample of exactly ``limit`` tokens is masked too
    per_message: bool  # NeMo-RL's cut (else: the first ``limit`` tokens)

    @classmethod
    def of(cls, cfg: Any, pairs: bool = False) -> LengthRule:
        """The run's rule: SFT's, or DPO's (``pairs``)."""
        max_input = getattr(cfg.data, "max_input_seq_length", None)
        if max_input is None:
            return cls(cfg.policy.max_total_sequence_length, "policy.max_total_sequence_length", False, False)
        return cls(max_input, "data.max_input_seq_length", not pairs, True)

    def too_long(self, length: int) -> bool:
        return length >= self.limit if self.masks_equal else length > self.limit

    def cut(self, chunks: list[Chunk]) -> Chunk:
        """A masked sample's ``(ids, mask)``: NeMo-RL's per-message cut, or the first ``limit`` tokens."""
        from rlcore.config.data import cut_tokens_per_message

        if not self.per_message:
            ids, mask = joined(chunks)
            return ids[: self.limit], mask[: self.limit]
        keep = cut_tokens_per_message(self.limit, len(chunks))
        return joined([(ids[:keep], mask[:keep]) for ids, mask in chunks])

    def fitted(self, chunks: list[Chunk], masked: bool) -> Chunk:
        """The sample's ``(ids, mask)`` as the batch holds it: whole, or cut when ``masked``."""
        return self.cut(chunks) if masked else joined(chunks)

    def too_long_words(self) -> str:
        """How a sample this rule masks is described in a message."""
        if self.masks_equal:
            return f"of {self.setting}={self.limit} tokens or more"
        return f"longer than {self.setting}={self.limit}"

    def keeping(self, longest: int) -> int:
        """The limit that would keep a sample of ``longest`` tokens."""
        return longest + 1 if self.masks_equal else longest


def sft_batch(samples: list[Sample], tokenizer: Any, cfg: Any, size: int | None = None) -> BatchedDataDict:
    """The training batch of ``samples``: right-padded ``input_ids``, ``input_lengths``, ``token_mask`` (the
    assistant's tokens) and ``sample_mask`` (0 for a sample cut by the :class:`LengthRule`, and for the masked
    rows that fill the batch up to ``size``)."""
    from rlcore.run.image_prompts import image_model_of
    from rlcore.run.prompts import pad_id

    rule = LengthRule.of(cfg)
    for sample in samples:  # a generator's samples meet this check here, a file's when the data was loaded
        if problem := answer_problem(sample, "data.train"):
            raise DataError(problem)
    image_model = image_model_of(cfg)
    encoded = [encoded_sample(s, tokenizer, cfg, image_model) for s in samples]
    keep = [not rule.too_long(sum(len(ids) for ids, _ in e.chunks)) for e in encoded]
    rows = [rule.fitted(e.chunks, not kept) for e, kept in zip(encoded, keep)]
    size = size or len(rows)
    rows += [rows[-1]] * (size - len(rows))  # filler rows, masked out below
    keep += [False] * (size - len(keep))
    batch = padded_batch(rows, keep, pad_id(tokenizer))
    if image_model is not None:
        add_pixels(batch, encoded, keep, image_model, pad_id(tokenizer))
    return batch


@dataclass(frozen=True)
class EncodedSample:
    """One sample's message chunks (an image's tokens expanded) and, for a vision-language run, its pixels."""

    chunks: list[Chunk]
    pixel_values: Any = None
    image_grid_thw: Any = None


def encoded_sample(sample: Sample, tokenizer: Any, cfg: Any, image_model: ImageModel | None) -> EncodedSample:
    """``sample`` through the chat template message by message; with ``image_model``, its images expanded."""
    if image_model is None:
        return EncodedSample(
            encode_messages(tokenizer, conversation(sample), cfg.sft, cfg.policy.tokenizer.chat_template_kwargs)
        )
    from rlcore.run.image_prompts import expand_image_chunks, rendering_images

    with rendering_images():
        chunks = encode_messages(tokenizer, conversation(sample), cfg.sft, cfg.policy.tokenizer.chat_template_kwargs)
    return EncodedSample(*expand_image_chunks(chunks, sample.images, image_model))


def add_pixels(
    batch: BatchedDataDict, encoded: list[EncodedSample], keep: list[bool], image_model: ImageModel, pad: int
) -> None:
    """The rows' ``pixel_values`` / ``image_grid_thw`` (docs/vision.md). A row that trains nothing (cut, or a
    filler) shows no image: its image tokens become padding, as a cut may have split an image's tokens."""
    pixels, grids = [], []
    for row, kept in enumerate(keep):
        if kept:
            pixels.append(encoded[row].pixel_values)
            grids.append(encoded[row].image_grid_thw)
            continue
        batch["input_ids"][row][batch["input_ids"][row] == image_model.image_token_id] = pad
        no_pixels, no_grid = image_model.no_pixels()
        pixels.append(no_pixels)
        grids.append(no_grid)
    batch["pixel_values"], batch["image_grid_thw"] = pixels, grids


def padded_batch(rows: list[tuple[list[int], list[int]]], keep: list[bool], pad: int) -> BatchedDataDict:
    """Right-padded ``input_ids``, ``input_lengths``, ``token_mask`` and ``sample_mask`` of ``(ids, mask)`` rows."""
    import torch

    from rlcore.data import BatchedDataDict

    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    token_mask = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, (ids, mask) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        token_mask[i, : len(mask)] = torch.tensor(mask, dtype=torch.float32)
    return BatchedDataDict(
        input_ids=input_ids,
        input_lengths=torch.tensor([len(ids) for ids, _ in rows], dtype=torch.long),
        token_mask=token_mask,
        sample_mask=torch.tensor(keep, dtype=torch.float32),
    )


def trains_a_token(ids: list[int], mask: list[int], rule: LengthRule) -> bool:
    """Whether an encoded sample trains: the rule keeps it and the loss reaches one of its tokens (the first
    token is never predicted)."""
    return not rule.too_long(len(ids)) and any(mask[1:])


def cut_reason(what: str, count: int, cut_lengths: list[int], rule: LengthRule) -> str:
    """Why ``count`` samples (or pairs) train nothing when those of ``cut_lengths`` tokens are cut by ``rule``
    (the others have no trained token)."""
    lo, hi = min(cut_lengths, default=0), max(cut_lengths, default=0)
    longer = f"{rule.too_long_words()} ({lo} to {hi} tokens)"
    fix = f"raise {rule.setting} (to {rule.keeping(hi)} to keep them all) or shorten them"
    if len(cut_lengths) == count:
        return f"all {count} {what} are {longer}, so each is cut and trains nothing; {fix}"
    if not cut_lengths:
        return f"none of its {count} {what} has a token to train (an assistant message's)"
    return (
        f"none of its {count} {what} trains a token: {len(cut_lengths)} are {longer} and cut, the others have "
        f"no assistant token; {fix}"
    )


def nothing_trained(samples: list[Sample], tokenizer: Any, cfg: Any) -> str | None:
    """Why no sample of ``samples`` trains a token (each cut by the :class:`LengthRule`, or without an assistant
    token), or None as soon as one does (the samples are encoded up to that one)."""
    from rlcore.run.image_prompts import image_model_of

    rule, cut, image_model = LengthRule.of(cfg), [], image_model_of(cfg)
    for sample in samples:
        ids, mask = joined(encoded_sample(sample, tokenizer, cfg, image_model).chunks)
        if trains_a_token(ids, mask, rule):
            return None
        if rule.too_long(len(ids)):
            cut.append(len(ids))
    return cut_reason("samples", len(samples), cut, rule)
