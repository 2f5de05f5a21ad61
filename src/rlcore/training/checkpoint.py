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
from pathlib import Path
from typing import Any, Iterator

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
DEFAULT_MAX_SHARD_SIZE_BYTES = 5 * 1024**3
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


def _prepare_tensors(state_dict: dict, tie_word_embeddings: bool) -> dict:
    """CPU, contiguous tensors with no two sharing storage (safetensors refuses aliasing).

    With tied embeddings the ``lm_head.weight`` duplicate is dropped, as
    ``save_pretrained`` does; ``from_pretrained`` re-ties it.
    """
    import torch

    tensors = dict(state_dict)
    if tie_word_embeddings:
        for key in [k for k in tensors if k == "lm_head.weight" or k.endswith(".lm_head.weight")]:
            embed_key = key[: -len("lm_head.weight")] + "model.embed_tokens.weight"
            if embed_key in tensors:
                if not torch.equal(tensors[key].detach().cpu(), tensors[embed_key].detach().cpu()):
                    raise ValueError(f"tie_word_embeddings is set but {key} differs from {embed_key}")
                del tensors[key]

    out = {}
    seen_storages: set[int] = set()
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor) or type(tensor).__name__ == "DTensor":
            raise TypeError(f"{name}: expected a full (non-distributed) torch.Tensor, got {type(tensor).__name__}")
        t = tensor.detach().to("cpu").contiguous()
        storage = t.untyped_storage()
        if storage.data_ptr() in seen_storages or storage.nbytes() != t.numel() * t.element_size():
            t = t.clone()
        seen_storages.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out


def _shard(tensors: dict, max_shard_size_bytes: int) -> list[dict]:
    """Split in key order into shards of at most ``max_shard_size_bytes`` (a larger tensor gets its own)."""
    shards: list[dict] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_size_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    return shards


def _write_config(hf_config: Any, directory: Path) -> None:
    if hasattr(hf_config, "to_json_file"):
        hf_config.to_json_file(str(directory / CONFIG_NAME))
        return
    data = dict(hf_config) if isinstance(hf_config, dict) else hf_config.to_dict()
    (directory / CONFIG_NAME).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def save_hf_checkpoint(
    state_dict: dict,
    hf_config: Any,
    path: str | os.PathLike,
    tokenizer: Any = None,
    max_shard_size_bytes: int = DEFAULT_MAX_SHARD_SIZE_BYTES,
) -> str:
    """Write a Hugging Face checkpoint that ``AutoModelForCausalLM.from_pretrained`` loads.

    ``state_dict`` holds full HF-named tensors (any device; DTensors must be
    gathered by the caller). Writes ``model.safetensors``, or
    ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``
    when the weights exceed ``max_shard_size_bytes``; ``config.json`` from an HF
    config object or a dict; the tokenizer files when ``tokenizer`` is given.
    The whole directory is published atomically (:func:`atomic_directory`).
    Returns ``str(path)``.
    """
    with atomic_directory(path) as tmp:
        write_hf_files(state_dict, hf_config, tmp, tokenizer, max_shard_size_bytes)
    return str(path)


def write_hf_files(state_dict: dict, hf_config: Any, directory: Path, tokenizer: Any = None,
                   max_shard_size_bytes: int = DEFAULT_MAX_SHARD_SIZE_BYTES) -> None:
    """The files of :func:`save_hf_checkpoint`, written into an existing ``directory`` (not atomic by itself)."""
    from safetensors.torch import save_file

    tensors = _prepare_tensors(state_dict, bool(_config_get(hf_config, "tie_word_embeddings", False)))
    shards = _shard(tensors, max_shard_size_bytes)
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(directory / SAFE_WEIGHTS_NAME), metadata=metadata)
    else:
        weight_map = {}
        for i, shard in enumerate(shards, start=1):
            filename = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(directory / filename), metadata=metadata)
            weight_map.update(dict.fromkeys(shard, filename))
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / SAFE_WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    _write_config(hf_config, directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(directory))


def load_hf_state_dict(path: str | os.PathLike) -> dict:
    """Read all tensors of an HF safetensors checkpoint directory (single file or sharded)."""
    from safetensors.torch import load_file

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
    "is_adapter_checkpoint",
    "load_hf_state_dict",
    "load_torch_state",
    "recover_checkpoint",
    "save_hf_checkpoint",
    "save_torch_state",
]
