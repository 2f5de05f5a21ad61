"""The byte-level tokenizer of the tiny models: 3 special tokens + 256 byte tokens, built locally.

Made with the ``tokenizers`` library, no download; transformers and tokenizers
are imported inside :func:`build_tiny_tokenizer`.
"""

from __future__ import annotations

import os

#: Special tokens, in id order: ``<pad>`` = 0, ``<s>`` = 1, ``</s>`` = 2.
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")
#: Byte ``b`` has token id ``BYTE_OFFSET + b``.
BYTE_OFFSET = len(SPECIAL_TOKENS)

#: A minimal chat format; ``add_generation_prompt`` opens an assistant turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _byte_to_char() -> dict[int, str]:
    """The printable-character alphabet used by byte-level BPE (GPT-2 style).

    Printable Latin-1 bytes stand for themselves; the remaining bytes are
    mapped, in byte order, to code points 256, 257, ... This is the alphabet
    the ``ByteLevel`` pre-tokenizer/decoder of ``tokenizers`` expects.
    """
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def build_tiny_tokenizer(save_dir: str | os.PathLike | None = None):
    """A byte-level tokenizer: 3 special tokens + 256 byte tokens, no merges.

    Ids are fixed: ``<pad>``=0, ``<s>``=1 (BOS), ``</s>``=2 (EOS), byte ``b`` is
    ``b + 3``. Every string round-trips exactly (``decode(encode(t)) == t``)
    because each UTF-8 byte is its own token and no BOS/EOS is added
    implicitly (the chat template adds BOS). Returns a
    ``transformers.PreTrainedTokenizerFast``; when ``save_dir`` is given it is
    also saved there with ``save_pretrained`` (``AutoTokenizer`` loads it).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for b, ch in _byte_to_char().items():
        vocab[ch] = BYTE_OFFSET + b
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # No regex split and no prefix space: the text is mapped byte by byte, unchanged.
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIAL_TOKENS))

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        clean_up_tokenization_spaces=False,
        padding_side="right",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    if save_dir is not None:
        tokenizer.save_pretrained(str(save_dir))
    return tokenizer
