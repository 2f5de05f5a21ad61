"""Tiny tokenizers, models and batches built locally, for tests and demos.

Nothing here downloads anything: the machines have no model hub access, so
every test model is made from a config with a fixed seed and a byte-level
tokenizer built with the ``tokenizers`` library. torch and transformers are
imported inside the functions so that ``rlcore`` stays importable without them.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

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

ARCHS = ("llama", "qwen2", "qwen3")

# Bump when the way models are built changes, so cached builds are not reused.
_BUILD_VERSION = 1


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


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _resolve_dtype(dtype: Any):
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    resolved = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return resolved


def build_tiny_model(
    save_dir: str | os.PathLike,
    arch: str = "llama",
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    head_dim: int = 32,
    intermediate_size: int = 128,
    vocab_size: int | None = None,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    dtype: Any = "float32",
    max_position_embeddings: int = 512,
    initializer_range: float = 0.02,
) -> str:
    """Build a randomly initialised causal LM and save it (+ tokenizer) to ``save_dir``.

    ``arch`` picks ``LlamaConfig`` / ``Qwen2Config`` (q/k/v biases) /
    ``Qwen3Config`` (q/k norms). Weights depend only on the arguments: they are
    drawn under ``seed`` inside a forked RNG, so the caller's global torch RNG
    is left as it was. ``vocab_size`` defaults to the tokenizer size rounded up
    to a multiple of 64 (padded rows, as real checkpoints have). ``head_dim``
    must be >= 32 (vLLM's attention kernels need it). Saved as safetensors;
    ``AutoModelForCausalLM.from_pretrained(path)`` loads it. Returns the path.
    """
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    if head_dim < 32:
        raise ValueError(f"head_dim must be >= 32 (vLLM needs it), got {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")

    tokenizer = build_tiny_tokenizer()
    if vocab_size is None:
        vocab_size = _round_up(len(tokenizer), 64)
    if vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer ({len(tokenizer)})")
    torch_dtype = _resolve_dtype(dtype)

    config_cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }[arch]
    config = config_cls(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=initializer_range,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    model.generation_config.pad_token_id = tokenizer.pad_token_id

    save_dir = Path(save_dir)
    save_dir.mkdir(parents=True, exist_ok=True)
    progress = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    try:
        model.save_pretrained(str(save_dir))
    finally:
        if progress:
            transformers.utils.logging.enable_progress_bar()
    tokenizer.save_pretrained(str(save_dir))
    return str(save_dir)


_BUILD_SIGNATURE = inspect.signature(build_tiny_model)


def default_cache_root() -> Path:
    """``$RLCORE_CACHE/tiny-models`` if set, else ``~/.cache/rlcore/tiny-models``."""
    base = os.environ.get("RLCORE_CACHE")
    root = Path(base) if base else Path.home() / ".cache" / "rlcore"
    return root / "tiny-models"


def tiny_model_path(cache_root: str | os.PathLike | None = None, **kwargs: Any) -> str:
    """Path of a tiny model built with ``build_tiny_model(**kwargs)``, built at most once.

    The directory name is a hash of the (normalised) arguments, the
    transformers version and a build version. The model is built in a temporary
    sibling directory and renamed into place, so concurrent test processes
    never see a half-written model: whoever renames first wins, the others
    discard their copy.
    """
    import transformers

    # Normalise through the signature so that defaults given explicitly hash the same.
    bound = _BUILD_SIGNATURE.bind("<dir>", **kwargs)
    bound.apply_defaults()
    key = {name: str(value) for name, value in bound.arguments.items() if name != "save_dir"}
    key["dtype"] = key["dtype"].removeprefix("torch.")
    key["_transformers"] = transformers.__version__
    key["_build"] = str(_BUILD_VERSION)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    root = Path(cache_root) if cache_root is not None else default_cache_root()
    final = root / f"{key['arch']}-{digest}"
    if (final / "config.json").exists():
        return str(final)

    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
    try:
        build_tiny_model(tmp, **kwargs)
        try:
            os.rename(tmp, final)
        except OSError:
            # Another process finished first (the target exists and is non-empty).
            if not (final / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(final)


def make_batch(
    tokenizer_or_vocab_size: Any,
    batch_size: int,
    min_len: int,
    max_len: int,
    seed: int = 0,
) -> dict:
    """A random, seeded, right-padded training batch.

    Returns a dict with
      - ``input_ids`` ``[B, S]`` int64, ``S`` = the longest sequence; padding
        is the tokenizer's pad id (0 for a plain vocab size);
      - ``input_lengths`` ``[B]`` int64, each in ``[min_len, max_len]``;
      - ``token_mask`` ``[B, S]`` float32: 1 on the "response" part, i.e.
        positions ``p <= i < length`` for a random prompt length
        ``1 <= p < length`` (so every sequence has >= 1 prompt and response token);
      - ``sample_mask`` ``[B]`` float32 ones.
    Token ids avoid the tokenizer's special tokens (any id in
    ``[0, vocab_size)`` for a plain vocab size). The global torch RNG is untouched.
    """
    import torch

    if min_len < 2 or max_len < min_len:
        raise ValueError(f"need 2 <= min_len <= max_len, got min_len={min_len}, max_len={max_len}")
    if isinstance(tokenizer_or_vocab_size, int):
        candidates = torch.arange(tokenizer_or_vocab_size)
        pad_id = 0
    else:
        tok = tokenizer_or_vocab_size
        special = set(tok.all_special_ids)
        candidates = torch.tensor([i for i in range(len(tok)) if i not in special])
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0

    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (batch_size,), generator=gen)
    seq_len = int(lengths.max())
    ids = candidates[torch.randint(len(candidates), (batch_size, seq_len), generator=gen)]
    # prompt length uniform in [1, length - 1]
    prompt_lens = 1 + (torch.rand(batch_size, generator=gen) * (lengths - 1)).long()

    positions = torch.arange(seq_len).unsqueeze(0)
    valid = positions < lengths.unsqueeze(1)
    input_ids = torch.where(valid, ids, torch.full_like(ids, pad_id))
    token_mask = (valid & (positions >= prompt_lens.unsqueeze(1))).float()
    return {
        "input_ids": input_ids.long(),
        "input_lengths": lengths.long(),
        "token_mask": token_mask,
        "sample_mask": torch.ones(batch_size, dtype=torch.float32),
    }
