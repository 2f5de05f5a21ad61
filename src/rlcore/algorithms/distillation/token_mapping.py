"""Cross-tokenizer distillation: a teacher whose tokenizer is not the student's.

The teacher reads the student's rollouts as text: each sequence's tokens are turned into their bytes, the
teacher's tokenizer encodes that text again, and the teacher gives its top-k at its own positions. Those are
carried back to the student's positions and vocabulary through the token strings:

- **Positions.** Student position ``i`` (it scores token ``i`` given the tokens before it) takes the teacher's
  row ``j`` when student token ``i`` and teacher token ``j`` start at the same byte of the text: both models
  have then read the same text and predict what follows it. A student position with no such teacher token
  (inside one of the teacher's longer tokens), position 0, and positions past the text both tokenizers agree on
  get no teacher row and are not distilled (their ``token_mask`` is cleared; the metric
  ``teacher_aligned_fraction`` says how many of the trained tokens were).
- **Vocabulary.** A teacher token maps to the student token with the same bytes (special tokens: the same text,
  or the same role: bos, eos, pad, unk). A teacher top-k entry with **no counterpart** in the student's vocabulary
  is left out: its slot gets the teacher logit ``-inf`` and the placeholder id 0, and the loss leaves such slots
  out of both distributions (the teacher is renormalised over its mapped ids, the student over the same ids).
  Two teacher entries that map to one student token (byte-fallback twins) are merged: the first slot gets the
  log-sum-exp of their logits, the other is left out.

Bytes of a token: a byte-level tokenizer's alphabet (GPT-2's) is mapped back to bytes; otherwise
SentencePiece's ``▁`` is a space and ``<0xNN>`` the byte ``NN``; added tokens are their text. When one tokenizer
adds a prefix (a leading space) the other does not, the texts are compared after it; where the two texts differ
otherwise, only the positions before the first difference are aligned.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from itertools import accumulate
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

#: Special-token roles mapped to each other when their texts differ (a teacher's eos is the student's eos).
SPECIAL_ROLES = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")
#: Positions processed at once when teacher entries mapping to one student token are merged (memory: chunk × k²).
_MERGE_CHUNK = 2048


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character → byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def _is_byte_level(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` decodes through a byte-level decoder (its tokens are GPT-2 alphabet strings)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    parts = decoder.get("decoders") or [decoder]
    return any(isinstance(part, dict) and part.get("type") == "ByteLevel" for part in parts)


def piece_bytes(token: str, byte_level: bool, alphabet: dict[str, int] | None = None) -> bytes:
    """The bytes a (non-added) token string stands for (see the module's docstring)."""
    if byte_level:
        alphabet = alphabet or _byte_alphabet()
        if all(ch in alphabet for ch in token):
            return bytes(alphabet[ch] for ch in token)
        return token.encode()
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        try:
            return bytes([int(token[3:5], 16)])
        except ValueError:
            pass
    return token.replace("▁", " ").encode()


def token_bytes(tokenizer: Any) -> list[bytes]:
    """Every id's bytes, ``len(tokenizer)`` of them (an id with no token: ``b""``)."""
    size = len(tokenizer)
    tokens = tokenizer.convert_ids_to_tokens(list(range(size)))
    added = {int(i): str(getattr(t, "content", t)) for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
    byte_level, alphabet = _is_byte_level(tokenizer), _byte_alphabet()
    return [
        added[i].encode() if i in added else b"" if tok is None else piece_bytes(tok, byte_level, alphabet)
        for i, tok in enumerate(tokens)
    ]


def vocabulary_map(
    teacher_bytes: Sequence[bytes],
    student_bytes: Sequence[bytes],
    roles: Sequence[tuple[int | None, int | None]] = (),
    student_preferred: Sequence[bool] | None = None,
) -> list[int]:
    """For each teacher id, the student id with the same bytes, or -1 (no counterpart).

    Among student ids with the same bytes the first ``student_preferred`` one wins (default: the lowest id).
    ``roles``: (teacher id, student id) pairs of special tokens of one role, mapped to each other whatever
    their texts."""
    preferred = student_preferred or [True] * len(student_bytes)
    by_bytes: dict[bytes, int] = {}
    for rank in (True, False):
        for sid, piece in enumerate(student_bytes):
            if piece and preferred[sid] is rank:
                by_bytes.setdefault(piece, sid)
    out = [by_bytes.get(piece, -1) if piece else -1 for piece in teacher_bytes]
    for tid, sid in roles:
        if tid is not None and sid is not None and 0 <= tid < len(out):
            out[tid] = sid
    return out


def aligned_rows(student_pieces: Sequence[bytes], teacher_pieces: Sequence[bytes]) -> list[int]:
    """For each student position, the teacher position whose token starts at the same byte of the text, or -1
    (position 0, a token starting inside one of the other's tokens, an empty token, text past where the two
    differ). See the module's docstring."""
    text_s, text_t = b"".join(student_pieces), b"".join(teacher_pieces)
    shift, limit = 0, len(text_s)
    if text_t != text_s:
        if text_t.endswith(text_s) or text_s.endswith(text_t):  # a prefix one tokenizer adds: compare after it
            shift = len(text_t) - len(text_s)
        else:
            limit = next((n for n, (a, b) in enumerate(zip(text_s, text_t)) if a != b), min(len(text_s), len(text_t)))
    teacher_at: dict[int, int] = {}
    for j, (start, piece) in enumerate(zip([0, *accumulate(len(p) for p in teacher_pieces)], teacher_pieces)):
        if j > 0 and piece:
            teacher_at.setdefault(start - shift, j)
    starts = [0, *accumulate(len(p) for p in student_pieces)]
    return [
        teacher_at.get(start, -1) if i > 0 and piece and start <= limit else -1
        for i, (start, piece) in enumerate(zip(starts, student_pieces))
    ]


def student_topk(
    logits: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor, vocab: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The teacher's top-k (``[B, T, k]`` logits and teacher ids at the teacher's positions) at the student's
    positions and in its vocabulary: ``rows`` ``[B, S]`` (teacher position per student position, -1 none),
    ``vocab`` ``[V_teacher]`` (student id per teacher id, -1 none). Returns ``[B, S, k]`` logits (``-inf`` in a
    slot left out), student ids (0 there) and ``[B, S]`` whether the position has a teacher row with at least one
    mapped entry."""
    import torch

    k = logits.shape[-1]
    at = rows.clamp(min=0)[..., None].expand(-1, -1, k)
    teacher_ids = torch.gather(ids.long(), 1, at)
    sid = torch.where(teacher_ids < vocab.numel(), vocab[teacher_ids.clamp(max=vocab.numel() - 1)], -1)
    ok = (sid >= 0) & (rows >= 0)[..., None]
    values = torch.gather(logits.float(), 1, at)
    merged, keep = _merge_duplicates(values.reshape(-1, k), sid.reshape(-1, k), ok.reshape(-1, k))
    merged, keep = merged.view_as(values), keep.view_as(ok)
    out = torch.where(keep, merged, float("-inf"))
    return out, torch.where(keep, sid, 0), keep.any(-1)


def _merge_duplicates(values: torch.Tensor, sid: torch.Tensor, ok: torch.Tensor) -> tuple[Any, Any]:
    """``[P, k]`` rows: slots mapping to one student id merged into the first (log-sum-exp), the others dropped."""
    import torch

    k = values.shape[-1]
    earlier = torch.ones(k, k, dtype=torch.bool, device=values.device).tril(-1)  # [j, l]: l before j
    merged, keep = torch.empty_like(values), torch.empty_like(ok)
    for lo in range(0, values.shape[0], _MERGE_CHUNK):
        v, s, o = values[lo : lo + _MERGE_CHUNK], sid[lo : lo + _MERGE_CHUNK], ok[lo : lo + _MERGE_CHUNK]
        same = (s[:, :, None] == s[:, None, :]) & o[:, :, None] & o[:, None, :]
        merged[lo : lo + _MERGE_CHUNK] = torch.logsumexp(torch.where(same, v[:, None, :], float("-inf")), -1)
        keep[lo : lo + _MERGE_CHUNK] = o & ~(same & earlier).any(-1)
    return merged, keep


class TeacherTokens:
    """The two tokenizers of a cross-tokenizer run and what maps one onto the other (built once per run)."""

    def __init__(self, student_tokenizer: Any, teacher_tokenizer: Any) -> None:
        import torch

        self.teacher_tokenizer = teacher_tokenizer
        self.student_bytes = token_bytes(student_tokenizer)
        self.teacher_bytes = token_bytes(teacher_tokenizer)
        added = set(int(i) for i in getattr(student_tokenizer, "added_tokens_decoder", {}))
        tokens = student_tokenizer.convert_ids_to_tokens(list(range(len(self.student_bytes))))
        preferred = [i not in added and not (t or "").startswith("<0x") for i, t in enumerate(tokens)]
        roles = [
            (getattr(teacher_tokenizer, role, None), getattr(student_tokenizer, role, None)) for role in SPECIAL_ROLES
        ]
        self.vocab = torch.tensor(vocabulary_map(self.teacher_bytes, self.student_bytes, roles, preferred))
        self.pad_id = int(getattr(teacher_tokenizer, "pad_token_id", None) or 0)

    def teacher_batch(
        self, input_ids: torch.Tensor, input_lengths: torch.Tensor, max_length: int
    ) -> tuple[Any, torch.Tensor]:
        """The teacher's batch (``input_ids`` re-encoded from the student's text, at most ``max_length``
        tokens each) and ``rows`` ``[B, S]`` (see :func:`aligned_rows`)."""
        import torch

        from rlcore.data import BatchedDataDict

        sequences, rows = [], torch.full(input_ids.shape, -1, dtype=torch.long)
        for b, (ids, length) in enumerate(zip(input_ids.tolist(), input_lengths.tolist())):
            pieces = [self.student_bytes[i] if 0 <= i < len(self.student_bytes) else b"" for i in ids[:length]]
            text = b"".join(pieces).decode("utf-8", errors="replace")
            teacher_ids = self.teacher_tokenizer(text, add_special_tokens=False)["input_ids"][:max_length]
            teacher_pieces = [self.teacher_bytes[i] if 0 <= i < len(self.teacher_bytes) else b"" for i in teacher_ids]
            rows[b, :length] = torch.tensor(aligned_rows(pieces, teacher_pieces), dtype=torch.long)
            sequences.append(teacher_ids)
        width = max(2, max(len(s) for s in sequences))
        padded = torch.full((len(sequences), width), self.pad_id, dtype=torch.long)
        for b, ids in enumerate(sequences):
            padded[b, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        lengths = torch.tensor([len(s) for s in sequences], dtype=torch.long)
        mask = (torch.arange(width)[None] < lengths[:, None]).float()
        return BatchedDataDict(
            input_ids=padded, input_lengths=lengths, token_mask=mask, sample_mask=torch.ones(len(sequences))
        ), rows


__all__ = ["TeacherTokens", "aligned_rows", "piece_bytes", "student_topk", "token_bytes", "vocabulary_map"]
