"""Cross-tokenizer distillation (issue 42): a teacher with a tokenizer of its own reads the student's text
re-tokenized, and its top-k come back to the student's positions and ids through the token strings
(:mod:`rlcore.algorithms.distillation.token_mapping`). Two different tokenizers are built here, offline: the
tiny models' byte-level one (the student) and a SentencePiece-style BPE with merges, byte fallback and other
special-token ids (the teacher). Each check has an independent reference: bytes from the tokenizers' own
decoding, a hand-written alignment, a float64 per-position recomputation of the mapping and of the loss."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from rlcore.algorithms.distillation import TEACHER_LOGITS_KEY, DistillationLossFn
from rlcore.algorithms.distillation.token_mapping import (
    TeacherTokens,
    aligned_rows,
    student_topk,
    token_bytes,
    vocabulary_map,
)
from rlcore.interfaces.loss import ENTROPY, LOGITS_AT_INDICES, LOGPROBS_AT_INDICES

WORDS = ["▁the", "▁cat", "▁sat", "▁on", "at", "he", "▁t", "▁c", "▁s"]
TEXT = "<s>the cat sat on thé mat\n</s>"


def teacher_tokenizer():
    """SentencePiece-style: ``▁`` for spaces, a prefix space, merges, ``<0xNN>`` byte fallback, and its specials
    at other ids than the student's (eos is ``<|end|>``); 299 ids, within the tiny teacher model's 320."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<|end|>": 1, "<s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for ch in "▁abcdefghijklmnopqrstuvwxyz":
        vocab.setdefault(ch, len(vocab))
    merges = []
    for word in WORDS:  # each word by merging its prefix with its last character
        for end in range(2, len(word) + 1):
            left, right = word[: end - 1], word[end - 1]
            if (left, right) not in merges:
                merges.append((left, right))
            vocab.setdefault(word[:end], len(vocab))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    backend.add_special_tokens(["<unk>", "<|end|>", "<s>"])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="<|end|>",
        pad_token="<unk>",
        clean_up_tokenization_spaces=False,
    )


@pytest.fixture(scope="module")
def student():
    from rlcore.models import build_tiny_tokenizer

    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def teacher():
    return teacher_tokenizer()


def test_each_token_s_bytes_are_what_the_tokenizer_decodes(student, teacher):
    """Bytes per id against the tokenizers' own decoding: a whole text decodes to its tokens' bytes joined."""
    for tokenizer, text in ((student, "héllo wörld\n"), (teacher, "the cat sat on thé mat\n")):
        table, ids = token_bytes(tokenizer), tokenizer(text, add_special_tokens=False)["input_ids"]
        assert b"".join(table[i] for i in ids).decode() == tokenizer.decode(ids) or b"".join(
            table[i] for i in ids
        ).decode().lstrip(" ") == tokenizer.decode(ids)
    table = token_bytes(teacher)
    assert table[teacher.convert_tokens_to_ids("▁cat")] == b" cat"
    assert table[teacher.convert_tokens_to_ids("<0x0A>")] == b"\n" and table[1] == b"<|end|>"
    assert token_bytes(student)[3 + 0xC3] == bytes([0xC3])  # a lone UTF-8 lead byte stays a byte


def test_teacher_ids_map_to_the_student_id_of_the_same_bytes(student, teacher):
    """Against an independent rule for this pair: the byte-level student has one token per byte, so a teacher
    token has a counterpart exactly when it is one byte (or a special of the same text or role)."""
    mapped = TeacherTokens(student, teacher).vocab.tolist()
    for tid in range(len(teacher)):
        token = teacher.convert_ids_to_tokens(tid)
        text = teacher.convert_tokens_to_string([token]) if tid > 2 else None
        if tid == 1:  # eos <|end|>: the student's eos </s> by role
            expected = student.eos_token_id
        elif tid == 2:  # <s>: the same text
            expected = student.convert_tokens_to_ids("<s>")
        elif tid == 0:  # <unk>, the teacher's pad too: the student's pad by role
            expected = student.pad_token_id
        elif token.startswith("<0x"):
            expected = 3 + int(token[3:5], 16)
        else:
            raw = token.replace("▁", " ").encode()
            expected = 3 + raw[0] if len(raw) == 1 else -1
        assert mapped[tid] == expected, (tid, token, text)


def test_a_token_without_a_counterpart_maps_to_minus_one_and_twins_to_the_preferred_id():
    student = [b"a", b"b", b"a", b"ab"]  # id 2 is a twin of id 0 (say a byte-fallback token)
    assert vocabulary_map([b"ab", b"c", b"a", b""], student, student_preferred=[False, True, True, True]) == [
        3,
        -1,
        2,
        -1,
    ]
    assert vocabulary_map([b"x"], student, roles=[(0, 1)]) == [1]


@pytest.mark.parametrize(
    "student_pieces, teacher_pieces, rows",
    [
        # same text, other boundaries: a position aligns where both tokens start at the same byte
        ([b"<s>", b"t", b"h", b"e", b" ", b"c", b"a", b"t"], [b"<s>", b"the", b" cat"], [-1, 1, -1, -1, 2, -1, -1, -1]),
        # the teacher adds a prefix space: compared after it
        ([b"t", b"he", b" c", b"at"], [b" the", b" cat"], [-1, -1, 1, -1]),
        # the texts differ after "ab": nothing past the first difference aligns
        ([b"a", b"b", b"c", b"d"], [b"a", b"b", b"x", b"d"], [-1, 1, 2, -1]),
        # an empty student token (no bytes) is never aligned
        ([b"a", b"", b"b"], [b"a", b"b"], [-1, -1, 1]),
    ],
)
def test_positions_align_where_both_tokens_start_at_the_same_byte(student_pieces, teacher_pieces, rows):
    assert aligned_rows(student_pieces, teacher_pieces) == rows


def _reference_topk(logits, ids, rows, vocab):
    """Per student position, in float64: the mapped teacher distribution {student id: probability}."""
    out = []
    for b in range(rows.shape[0]):
        for i in range(rows.shape[1]):
            j, mass = int(rows[b, i]), {}
            if j >= 0:
                for slot in range(ids.shape[-1]):
                    sid = int(vocab[int(ids[b, j, slot])])
                    if sid >= 0:
                        mass[sid] = mass.get(sid, 0.0) + math.exp(float(logits[b, j, slot]))
            total = sum(mass.values())
            out.append({sid: m / total for sid, m in mass.items()})
    return out


def test_the_mapped_top_k_is_the_teacher_s_distribution_over_mapped_ids(monkeypatch):
    """Random top-k against a float64 per-position recomputation, with unmapped ids and twins merged."""
    import rlcore.algorithms.distillation.token_mapping as mapping

    monkeypatch.setattr(mapping, "_MERGE_CHUNK", 3)  # several chunks
    gen = torch.Generator().manual_seed(0)
    vocab = torch.tensor([0, -1, 2, 2, 5, -1, 1, 4])  # teacher ids 2 and 3 are twins, 1 and 5 have none
    logits = torch.randn(2, 6, 4, generator=gen, dtype=torch.float64)
    ids = torch.stack([torch.randperm(8, generator=gen)[:4] for _ in range(12)]).view(2, 6, 4)
    ids[0, 2] = torch.tensor([1, 5, 1, 5])  # a row with no mapped entry
    rows = torch.tensor([[-1, 1, 2, 3, 5, -1, 4], [-1, -1, 1, 2, 3, 4, 5]])
    out, sid, found = student_topk(logits, ids, rows, vocab)
    assert out.shape == sid.shape == (2, 7, 4) and out.dtype == torch.float32
    for n, expected in enumerate(_reference_topk(logits, ids, rows, vocab)):
        b, i = divmod(n, 7)
        assert bool(found[b, i]) == bool(expected), (b, i)
        got = {}
        for p, s in zip(torch.softmax(out[b, i].double(), -1).tolist() if expected else [], sid[b, i].tolist()):
            if p > 0:
                assert s not in got  # each student id once
                got[s] = p
        assert got.keys() == expected.keys()
        assert all(abs(got[s] - expected[s]) < 1e-6 for s in expected)
        assert all(s == 0 for s, v in zip(sid[b, i].tolist(), out[b, i].tolist()) if v == float("-inf"))


def _context_logits(context: bytes, width: int) -> torch.Tensor:
    """A fake teacher: its logits over ``width`` ids depend on the text it has read, nothing else."""
    gen = torch.Generator().manual_seed(int.from_bytes(context[-6:].rjust(6, b"\0"), "big") + len(context))
    return torch.randn(width, generator=gen, dtype=torch.float64)


def test_the_teacher_reads_the_student_s_text_and_its_rows_come_back_where_the_text_is_the_same(student, teacher):
    """End to end on the driver: student ids → the teacher's batch → a fake teacher whose distribution is a
    function of the text read → the student's positions. At every aligned position the mapped distribution is
    the teacher's for the student's own text prefix, computed here from the text alone."""
    tokens = TeacherTokens(student, teacher)
    rows_text = [TEXT, "<s>a cat on the mat</s>"]
    ids = [student(text, add_special_tokens=False)["input_ids"] for text in rows_text]
    width = max(map(len, ids)) + 3
    input_ids = torch.zeros(len(ids), width, dtype=torch.long)
    for b, row in enumerate(ids):
        input_ids[b, : len(row)] = torch.tensor(row)
    lengths = torch.tensor([len(row) for row in ids])
    batch, rows = tokens.teacher_batch(input_ids, lengths, max_length=64)
    assert batch["input_ids"][0, 0] == teacher.convert_tokens_to_ids("<s>")  # its own special, not 3 bytes
    k, v_t = 5, len(teacher)
    logits = torch.zeros(*batch["input_ids"].shape, k, dtype=torch.float64)
    top_ids = torch.zeros(*batch["input_ids"].shape, k, dtype=torch.long)
    for b in range(len(ids)):  # row j: the teacher's top-k having read its tokens before j
        seq = batch["input_ids"][b, : int(batch["input_lengths"][b])].tolist()
        for j in range(1, len(seq)):
            context = b"".join(tokens.teacher_bytes[t] for t in seq[:j])
            values, which = _context_logits(context, v_t).topk(k)
            logits[b, j], top_ids[b, j] = values, which
    out, sid, found = student_topk(logits, top_ids, rows, tokens.vocab)
    aligned = 0
    for b, row in enumerate(ids):
        text = b"".join(tokens.student_bytes[t] for t in row)
        for i in range(1, len(row)):
            start = len(b"".join(tokens.student_bytes[t] for t in row[:i]))
            if not found[b, i]:
                continue
            aligned += 1
            context = (b" " if text.startswith(b"<s>") is False else b"") + text[:start]
            values, which = _context_logits(context, v_t).topk(k)
            mass = {}
            for value, tid in zip(values.tolist(), which.tolist()):
                if int(tokens.vocab[tid]) >= 0:
                    mass[int(tokens.vocab[tid])] = mass.get(int(tokens.vocab[tid]), 0.0) + math.exp(value)
            got = {s: p for s, p in zip(sid[b, i].tolist(), torch.softmax(out[b, i].double(), -1).tolist()) if p}
            assert got.keys() == mass.keys(), (b, i)
            assert all(abs(got[s] - m / sum(mass.values())) < 1e-6 for s, m in mass.items())
    assert aligned >= 8  # word starts ("the", " cat", ...) and single-byte teacher tokens align
    assert not found[0, 0] and not found[:, lengths.max() :].any()


def _loss_data(zero_outside: bool, kl_type: str):
    gen = torch.Generator().manual_seed(3)
    b, s, k = 2, 5, 4
    teacher = torch.randn(b, s, k, generator=gen, dtype=torch.float64)
    teacher[0, 2, 1] = teacher[1, 3, 0] = teacher[1, 3, 3] = float("-inf")  # slots with no counterpart
    student = torch.randn(b, s, k, generator=gen, dtype=torch.float64)
    data = {
        "input_lengths": torch.tensor([5, 4]),
        "token_mask": ((torch.arange(s)[None] >= 1) & (torch.arange(s)[None] < torch.tensor([[5], [4]]))).float(),
        "sample_mask": torch.ones(b),
        TEACHER_LOGITS_KEY: teacher,
    }
    if zero_outside:
        data[LOGPROBS_AT_INDICES] = torch.log_softmax(torch.cat([student, torch.zeros(b, s, 3)], -1), -1)[..., :k]
        data[ENTROPY] = torch.rand(b, s, generator=gen, dtype=torch.float64) + 1.0
    else:
        data[LOGITS_AT_INDICES] = student
    return data


@pytest.mark.parametrize(
    "zero_outside, kl_type", [(False, "mixed"), (True, "mixed"), (True, "forward"), (False, "reverse")]
)
def test_the_loss_leaves_slots_without_a_counterpart_out_of_both_distributions(zero_outside, kl_type):
    """The loss with ``-inf`` teacher slots equals the loss computed over the mapped slots alone (float64,
    per position), and its gradient is finite and zero at the slots left out."""
    data = _loss_data(zero_outside, kl_type)
    key = LOGPROBS_AT_INDICES if zero_outside else LOGITS_AT_INDICES
    student = data[key].clone().requires_grad_(True)
    fn = DistillationLossFn({"kl_type": kl_type, "zero_outside_topk": zero_outside})
    loss, _ = fn(torch.zeros(2, 5), {**data, key: student}, torch.tensor(2.0), torch.tensor(7.0))
    loss.backward()
    w = {"forward": 1.0, "reverse": 0.0, "mixed": 0.5}[kl_type]
    total = 0.0
    for b, length in enumerate((5, 4)):
        for i in range(1, length):
            keep = data[TEACHER_LOGITS_KEY][b, i] > float("-inf")
            p = torch.softmax(data[TEACHER_LOGITS_KEY][b, i][keep], -1)
            log_q = data[key][b, i][keep] if zero_outside else torch.log_softmax(data[key][b, i][keep], -1)
            q = log_q.exp()
            forward = float((p * (p.log() - log_q)).sum())
            reverse = float((q * (log_q - p.log())).sum())
            if zero_outside and kl_type != "forward":
                reverse += -float(data[ENTROPY][b, i]) - float((q * log_q).sum()) + 100.0 * (1 - float(q.sum()))
            total += w * forward + (1 - w) * reverse
    assert float(loss.detach()) == pytest.approx(total / 7.0, rel=1e-5, abs=1e-6)
    assert torch.isfinite(student.grad).all()
    left_out = data[TEACHER_LOGITS_KEY] == float("-inf")
    assert (student.grad[left_out] == 0).all()


def test_with_every_slot_mapped_the_loss_is_unchanged():
    """A top-k with no slot left out gives the same loss as before the cross-tokenizer rule (same tensors)."""
    data = _loss_data(False, "mixed")
    data[TEACHER_LOGITS_KEY] = torch.nan_to_num(data[TEACHER_LOGITS_KEY], neginf=0.5)
    loss, _ = DistillationLossFn({})(torch.zeros(2, 5), data, torch.tensor(2.0), torch.tensor(7.0))
    p = torch.softmax(data[TEACHER_LOGITS_KEY], -1)
    log_q = torch.log_softmax(data[LOGITS_AT_INDICES], -1)
    per = 0.5 * (p * (p.log() - log_q)).sum(-1) + 0.5 * (log_q.exp() * (log_q - p.log())).sum(-1)
    assert float(loss) == pytest.approx(float((per * data["token_mask"]).sum() / 7.0), rel=1e-6)


# -- config: distillation.teacher.tokenizer ---------------------------------------------------------------------


def _distillation(**teacher):
    from rlcore.algorithms.distillation.config import DistillationConfig

    return DistillationConfig(teacher_model_name="tiny-teacher", teacher=teacher)


def test_the_teacher_s_own_tokenizer_is_accepted_and_becomes_its_policy_s():
    policy = SimpleNamespace(
        model_name="tiny-llama",
        tokenizer=SimpleNamespace(name="tiny-llama", model_dump=lambda **_: {"name": "tiny-llama"}),
        model_dump=lambda **_: {"precision": "float32"},
    )
    d = _distillation(tokenizer={"name": "/models/teacher-tok"})
    assert d.teacher_tokenizer(policy) == "/models/teacher-tok"
    assert d.teacher_policy(policy)["tokenizer"] == {"name": "/models/teacher-tok"}
    same = _distillation(tokenizer={"name": "tiny-llama"})
    assert same.teacher_tokenizer(policy) is None and _distillation().teacher_tokenizer(policy) is None


def test_a_teacher_tokenizer_setting_other_than_its_name_is_refused_in_one_line():
    from pydantic import ValidationError

    with pytest.raises(
        ValidationError,
        match=r"distillation.teacher.tokenizer: only its name is the teacher's own "
        r"\(not \['chat_template'\]\)",
    ):
        _distillation(tokenizer={"name": "x", "chat_template": "default"})


def _run(student_tok, teacher_model: str, **teacher):
    policy = SimpleNamespace(model_name="student", tokenizer=SimpleNamespace(name="student"))
    d = _distillation(**teacher).model_copy(update={"teacher_model_name": teacher_model})
    return SimpleNamespace(cfg=SimpleNamespace(distillation=d, policy=policy), tokenizer=student_tok)


def test_a_teacher_of_another_vocabulary_is_refused_unless_its_tokenizer_is_named(tmp_path, student, teacher):
    """NeMo-RL's check_vocab_equality refuses a teacher model whose tokenizer's vocabulary is not the student's;
    so does rlcore, naming the setting that maps it instead (``distillation.teacher.tokenizer.name``)."""
    from rlcore.algorithms.distillation.loop import teacher_tokens
    from rlcore.config import ConfigError

    teacher.save_pretrained(str(tmp_path / "teacher"))
    student.save_pretrained(str(tmp_path / "same"))
    with pytest.raises(
        ConfigError,
        match=r"distillation.teacher_model_name: the teacher's vocabulary \(\d+ tokens\) "
        r"is not the student's \(259\).*set distillation.teacher.tokenizer.name",
    ):
        teacher_tokens(_run(student, str(tmp_path / "teacher")))
    assert teacher_tokens(_run(student, str(tmp_path / "same"))) is None
    assert teacher_tokens(_run(student, str(tmp_path / "no-tokenizer-here"))) is None
    mapped = teacher_tokens(_run(student, str(tmp_path / "teacher"), tokenizer={"name": str(tmp_path / "teacher")}))
    assert isinstance(mapped, TeacherTokens) and mapped.vocab.numel() == len(teacher)
    assert teacher_tokens(_run(student, "x", tokenizer={"name": str(tmp_path / "same")})) is None  # same vocabulary


def test_a_vocabulary_that_only_adds_tokens_at_new_ids_is_the_same():
    """The tiny Qwen2 teacher's tokenizer adds ``<|endoftext|>`` at id 259 to the student's 259 ids: same ids.
    A token at another id, or an id holding another token, is another vocabulary."""
    from rlcore.algorithms.distillation.loop import same_ids

    student = {"<pad>": 0, "a": 1, "b": 2}
    assert same_ids(student, {**student, "<|endoftext|>": 3}) and same_ids(student, {"a": 1})
    assert not same_ids(student, {"<pad>": 0, "a": 2, "b": 1})
    assert not same_ids(student, {"<pad>": 0, "a": 1, "c": 2})
