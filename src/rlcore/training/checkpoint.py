"""Atomic checkpoint writing and Hugging Face safetensors I/O (no pickle).

Crash-consistency guarantee of :func:`atomic_directory` (one writer per path):
everything is written into a temporary sibling directory and fsync'ed; then
the old checkpoint is renamed to ``.<name>.old``, the new one is renamed to
``<name>`` and the old one is deleted. Renames within one directory are atomic,
so at every instant one of these holds:

1. ``<name>`` is the old complete checkpoint (crash before the first rename);
2. ``<name>`` is missing and ``.<name>.old`` is the old complete checkpoint
   (crash between the two renames);
3. ``<name>`` is the new complete checkpoint (``.<name>.old``, if still there,
   is garbage, possibly half deleted).

:func:`recover_checkpoint` turns case 2 back into case 1 and clears the garbage
of cases 1 and 3 (``.old`` next to a present checkpoint, leftover temporary
directories). ``atomic_directory`` calls it first; a loader that may run after
a crash should call it once (from one process) before reading.

torch is imported inside the functions: ``rlcore`` stays importable without it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
#: A save holds at most one shard in memory (on the writing rank), so shards are kept small;
#: Hugging Face and vLLM load any number of them.
DEFAULT_MAX_SHARD_SIZE_BYTES = 512 * 1024**2
#: A LoRA checkpoint's weights directory is a PEFT adapter: these two files (see rlcore.training.lora).
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
ADAPTER_CONFIG_NAME = "adapter_config.json"


def is_adapter_checkpoint(path: str | os.PathLike | None) -> bool:
    """Whether ``path`` holds a PEFT adapter (LoRA) rather than a full model."""
    return path is not None and (Path(path) / ADAPTER_CONFIG_NAME).is_file()


# --------------------------------------------------------------------------- atomicity


def backup_path(final_path: str | os.PathLike) -> Path:
    """Where the previous checkpoint sits during the swap: the hidden sibling ``.<name>.old``.

    Hidden, so that globbing checkpoint names (``step_*``) never picks it up.
    """
    final = Path(final_path)
    return final.with_name(f".{final.name}.old")


def _tmp_prefix(final: Path) -> str:
    return f".{final.name}.tmp-"


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root`` so a rename publishes durable data."""
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            _fsync_path(Path(dirpath) / name)
        _fsync_path(Path(dirpath))


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def recover_checkpoint(final_path: str | os.PathLike) -> bool:
    """Repair ``final_path`` after a crash in :func:`atomic_directory`; True if it restored one.

    - ``final_path`` missing, backup present → the crash hit between the two
      renames; the backup is the complete previous checkpoint: rename it back.
    - both present → the new checkpoint was published; the backup is garbage.
    - temporary directories of interrupted writes are removed.

    Assumes nobody is writing ``final_path`` concurrently.
    """
    final = Path(final_path)
    old = backup_path(final)
    restored = False
    if old.exists():
        if final.exists():
            _remove(old)
        else:
            os.rename(old, final)
            _fsync_path(final.parent)
            restored = True
    if final.parent.is_dir():
        for stale in final.parent.glob(_tmp_prefix(final) + "*"):
            _remove(stale)
    return restored


@contextlib.contextmanager
def atomic_directory(final_path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary directory that replaces ``final_path`` atomically on success.

    The temporary directory is a sibling of ``final_path`` (same filesystem, so
    the rename is atomic). If the body raises, the temporary directory is
    removed and any previous checkpoint at ``final_path`` is left untouched.
    See the module docstring for the crash-consistency guarantee.
    """
    final = Path(final_path)
    final.parent.mkdir(parents=True, exist_ok=True)
    recover_checkpoint(final)
    tmp = Path(tempfile.mkdtemp(prefix=_tmp_prefix(final), dir=final.parent))
    try:
        yield tmp
        _fsync_tree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _publish(tmp, final)


def _publish(tmp: Path, final: Path) -> None:
    """The two-rename swap: old aside, new into place, then delete old."""
    old = backup_path(final)
    had_old = final.exists() or final.is_symlink()
    if had_old:
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_path(final.parent)
    if had_old:
        _remove(old)


# --------------------------------------------------------------------------- HF safetensors


def _config_get(config: Any, key: str, default: Any = None) -> Any:
    if isinstance(config, dict):
        return config.get(key, default)
    return getattr(config, key, default)


def _check_tie(state_dict: Mapping, tie_word_embeddings: bool) -> None:
    """A tied head must equal its embedding: the writer drops it (``from_pretrained`` re-ties it)."""
    import torch

    if not tie_word_embeddings:
        return
    for key in [k for k in state_dict if _is_tied_head(k, True)]:
        embed_key = key[: -len("lm_head.weight")] + "model.embed_tokens.weight"
        if embed_key in state_dict and not torch.equal(
            state_dict[key].detach().cpu(), state_dict[embed_key].detach().cpu()
        ):
            raise ValueError(f"tie_word_embeddings is set but {key} differs from {embed_key}")


def _is_tied_head(name: str, tie_word_embeddings: bool) -> bool:
    return tie_word_embeddings and (name == "lm_head.weight" or name.endswith(".lm_head.weight"))


_SAFETENSORS_DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
}


def _write_safetensors(tensors: dict, path: Path, metadata: dict[str, str]) -> None:
    """One safetensors file, each tensor's bytes written straight from its storage.

    ``safetensors.torch.save_file`` first copies every tensor into a Python
    ``bytes`` object, doubling a shard's memory; this writes the same format
    (8-byte header length, JSON header padded to 8 bytes, data) with no copy.
    """
    import torch

    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        dtype = _SAFETENSORS_DTYPES.get(str(t.dtype).removeprefix("torch."))
        if dtype is None:
            raise TypeError(f"{name}: safetensors cannot hold {t.dtype} (one of {sorted(_SAFETENSORS_DTYPES)})")
        header[name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as f:
        f.write(len(encoded).to_bytes(8, "little"))
        f.write(encoded)
        for t in tensors.values():
            if t.numel():
                f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))


class _ShardedWriter:
    """Writes ``(name, tensor)`` pairs as they come, holding at most one shard in memory.

    Shards are written under temporary names; :meth:`close` names them the
    way Hugging Face does (``model.safetensors`` alone, or
    ``model-0000i-of-0000n.safetensors`` + the index) once their number is known.
    """

    def __init__(self, directory: Path, max_shard_size_bytes: int) -> None:
        self.directory = directory
        self.max_bytes = max_shard_size_bytes
        self.pending: dict = {}
        self.pending_bytes = 0
        self.weight_map: dict[str, int] = {}  # name -> shard index
        self.shards = 0
        self.total_bytes = 0

    def add(self, name: str, tensor: Any) -> None:
        """Copy ``tensor`` in (its source may be freed or reused once the next one is gathered)."""
        import torch

        if not isinstance(tensor, torch.Tensor) or type(tensor).__name__ == "DTensor":
            raise TypeError(f"{name}: expected a full (non-distributed) torch.Tensor, got {type(tensor).__name__}")
        t = tensor.detach().to("cpu", copy=True, memory_format=torch.contiguous_format)
        nbytes = t.numel() * t.element_size()
        if self.pending and self.pending_bytes + nbytes > self.max_bytes:
            self._flush()
        self.pending[name] = t
        self.pending_bytes += nbytes
        self.total_bytes += nbytes

    def _part(self, index: int) -> Path:
        return self.directory / f".part-{index:05d}.safetensors"

    def _flush(self) -> None:
        _write_safetensors(self.pending, self._part(self.shards), {"format": "pt"})
        self.weight_map.update(dict.fromkeys(self.pending, self.shards))
        self.shards += 1
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> None:
        if self.pending or not self.shards:
            self._flush()
        if self.shards == 1:
            os.rename(self._part(0), self.directory / SAFE_WEIGHTS_NAME)
            return
        names = [f"model-{i + 1:05d}-of-{self.shards:05d}.safetensors" for i in range(self.shards)]
        for i, filename in enumerate(names):
            os.rename(self._part(i), self.directory / filename)
        index = {
            "metadata": {"total_size": self.total_bytes},
            "weight_map": {name: names[i] for name, i in self.weight_map.items()},
        }
        (self.directory / SAFE_WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


def _write_config(hf_config: Any, directory: Path) -> None:
    if hasattr(hf_config, "to_json_file"):
        hf_config.to_json_file(str(directory / CONFIG_NAME))
        return
    data = dict(hf_config) if isinstance(hf_config, dict) else hf_config.to_dict()
    (directory / CONFIG_NAME).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def save_hf_checkpoint(
    tensors: Mapping | Iterable[tuple[str, Any]],
    hf_config: Any,
    path: str | os.PathLike,
    tokenizer: Any = None,
    max_shard_size_bytes: int = DEFAULT_MAX_SHARD_SIZE_BYTES,
) -> str:
    """Write a Hugging Face checkpoint that ``AutoModelForCausalLM.from_pretrained`` loads.

    ``tensors`` is a state dict or an iterable of ``(name, tensor)`` pairs of
    full HF-named tensors (any device; DTensors must be gathered by the
    caller). An iterable is written as it is consumed, so a sharded model
    can be saved one gathered tensor at a time with at most one shard
    (``max_shard_size_bytes``) in memory. Writes ``model.safetensors``, or
    ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``
    when the weights exceed one shard; ``config.json`` from an HF config
    object or a dict; the tokenizer files when ``tokenizer`` is given. With
    tied embeddings the ``lm_head.weight`` duplicate is dropped, as
    ``save_pretrained`` does. The whole directory is published atomically
    (:func:`atomic_directory`). Returns ``str(path)``.
    """
    with atomic_directory(path) as tmp:
        write_hf_files(tensors, hf_config, tmp, tokenizer, max_shard_size_bytes)
    return str(path)


def write_hf_files(
    tensors: Mapping | Iterable[tuple[str, Any]],
    hf_config: Any,
    directory: Path,
    tokenizer: Any = None,
    max_shard_size_bytes: int = DEFAULT_MAX_SHARD_SIZE_BYTES,
) -> None:
    """The files of :func:`save_hf_checkpoint`, written into an existing ``directory`` (not atomic by itself)."""
    tied = bool(_config_get(hf_config, "tie_word_embeddings", False))
    if isinstance(tensors, Mapping):
        _check_tie(tensors, tied)
        tensors = tensors.items()
    writer = _ShardedWriter(directory, max_shard_size_bytes)
    for name, tensor in tensors:
        if not _is_tied_head(name, tied):
            writer.add(name, tensor)
    writer.close()
    _write_config(hf_config, directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(directory))


#: A vision-language model's processor files, kept beside its tokenizer's (rlcore.run.image_prompts reads them).
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


def save_tokenizer(tokenizer: Any, path: str | os.PathLike) -> None:
    """The tokenizer's files in directory ``path``, published atomically; with them the image processor's files
    of the directory the tokenizer was loaded from, if it has some (a checkpoint of a vision-language model
    then starts a run of its own: ``policy.warm_start``)."""
    source = Path(str(getattr(tokenizer, "name_or_path", "") or ""))
    with atomic_directory(path) as tmp:
        tokenizer.save_pretrained(str(tmp))
        copy_processor_files(source, Path(tmp))


def copy_processor_files(source: Path, target: Path) -> None:
    """The :data:`PROCESSOR_FILES` that directory ``source`` has, copied into directory ``target`` (none when
    ``source`` is not a directory: a hub id, a text model)."""
    if not source.is_dir():
        return
    for name in PROCESSOR_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, target / name)


def load_hf_state_dict(path: str | os.PathLike) -> dict:
    """Read all tensors of an HF safetensors checkpoint directory (single file or sharded).

    Every file read must lie inside ``path`` (:mod:`rlcore.training.checkpoint_files`).
    """
    from safetensors.torch import load_file

    from rlcore.training.checkpoint_files import check_inside

    check_inside(path)
    directory = Path(path)
    index_file = directory / SAFE_WEIGHTS_INDEX_NAME
    if index_file.exists():
        weight_map = json.loads(index_file.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    elif (directory / SAFE_WEIGHTS_NAME).exists():
        files = [SAFE_WEIGHTS_NAME]
    else:
        raise FileNotFoundError(f"no {SAFE_WEIGHTS_NAME} or {SAFE_WEIGHTS_INDEX_NAME} in {directory}")
    state_dict: dict = {}
    for filename in files:
        state_dict.update(load_file(str(directory / filename)))
    return state_dict


# --------------------------------------------------------------------------- small torch state


def save_torch_state(obj: dict, path: str | os.PathLike) -> None:
    """``torch.save`` ``obj`` to the file ``path`` atomically (temp file + fsync + rename).

    For small things (scheduler state, step counters, RNG states). Keep ``obj``
    to tensors, containers and primitives: :func:`load_torch_state` refuses
    anything else.
    """
    import torch

    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{final.name}.tmp-", dir=final.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_name, final)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise
    _fsync_path(final.parent)


def load_torch_state(path: str | os.PathLike) -> Any:
    """Load a :func:`save_torch_state` file onto CPU with ``weights_only=True`` (no arbitrary pickle).

    Through :func:`rlcore.safe_pickle.torch_load`: torch's own allow-list only,
    whatever other libraries in the process registered, and a refusal names the file.
    """
    from rlcore.safe_pickle import torch_load

    return torch_load(str(path), str(path))


__all__ = [
    "atomic_directory",
    "backup_path",
    "copy_processor_files",
    "is_adapter_checkpoint",
    "load_hf_state_dict",
    "load_torch_state",
    "recover_checkpoint",
    "save_hf_checkpoint",
    "save_tokenizer",
    "save_torch_state",
]
