"""Is the model (and tokenizer) a config names actually loadable? Checked before Ray starts.

Without this, a missing directory or a truncated weight file surfaces 30-60 s
into a run as a long traceback from inside a worker. These checks read only
what is cheap: ``config.json``, the index of a sharded checkpoint and each
safetensors file's header (never the tensor data, so a 16 GB model takes
milliseconds). They never touch the network and never import torch.

Each problem is one line, ``<dotted config path>: <what is wrong>; <the fix>``,
the same shape as :class:`rlcore.config.ConfigError` lines, so a CLI can print
them as they are.

Built-in names (``tiny-llama``) must be resolved to paths first
(:func:`rlcore.models.resolve_builtin_models`).
"""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlcore.training.checkpoint import (
    ADAPTER_CONFIG_NAME,
    ADAPTER_WEIGHTS_NAME,
    CONFIG_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    is_adapter_checkpoint,
)

if TYPE_CHECKING:
    from rlcore.config import GenerationConfig, PolicyConfig, RLCoreConfig
    from rlcore.config.policy import LoRAConfig

__all__ = ["HUB_CACHE_FILES", "check_model", "check_model_sources", "check_policy_sources", "hub_offline", "is_hub_id"]

PICKLE_WEIGHTS_NAME = "pytorch_model.bin"
PICKLE_WEIGHTS_INDEX_NAME = "pytorch_model.bin.index.json"

#: Bits per element of every dtype name the safetensors format defines.
SAFETENSORS_DTYPE_BITS: dict[str, int] = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "F8_E8M0": 8,
    "U16": 16,
    "I16": 16,
    "F16": 16,
    "BF16": 16,
    "U32": 32,
    "I32": 32,
    "F32": 32,
    "U64": 64,
    "I64": 64,
    "F64": 64,
    "C64": 64,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
}

#: The safetensors library refuses headers larger than this.
_MAX_HEADER_BYTES = 100 * 1024 * 1024

#: What a Hugging Face hub repository id looks like (``gpt2``, ``Qwen/Qwen2.5-0.5B``).
_HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")
#: The files whose cached copy shows a hub model (or its tokenizer) was downloaded.
HUB_CACHE_FILES = (CONFIG_NAME, "tokenizer_config.json", "tokenizer.json")

_VOCAB_FILES = ("tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "vocab.json", "vocab.txt")

_RESAVE = "re-download or re-save the model"


def check_model_sources(cfg: RLCoreConfig) -> list[str]:
    """Problems with the model, tokenizer and generation model of a run config; empty when all load.

    ``cfg`` is a validated ``RLCoreConfig`` whose built-in model names are
    already resolved. A directory several fields share is reported once,
    under the first of them.
    """
    policy = cfg.policy
    checks = _Checks()
    checks.model("policy.model_name", policy.model_name)
    tokenizer = policy.tokenizer.name or policy.model_name
    shared = " (the directory of policy.model_name)" if tokenizer == policy.model_name else ""
    checks.tokenizer("policy.tokenizer.name", tokenizer, shared)
    gen = policy.generation
    if gen is not None and gen.model_name and gen.backend != policy.training_backend:
        checks.model("policy.generation.model_name", gen.model_name, weights=_engine_loads_weights(gen))
    return checks.problems


def check_model(field: str, name: str) -> list[str]:
    """Problems with the model directory (or hub name) ``name`` that the config's ``field`` names: its
    ``config.json`` and weights, as :func:`check_model_sources` checks the policy's (a distillation teacher's)."""
    checks = _Checks()
    checks.model(field, name)
    return checks.problems


def check_policy_sources(
    policy: PolicyConfig,
    weights_path: str | os.PathLike | None = None,
    optimizer_path: str | os.PathLike | None = None,
    *,
    fields: tuple[str, str] = ("weights_path", "optimizer_path"),
) -> list[str]:
    """Problems with what the training workers of a ``Policy`` load: ``weights_path`` if given, else the model,
    and ``optimizer_path``. A checkpoint must read its own files only (:mod:`rlcore.training.checkpoint_files`).
    ``fields``: what the lines call the two paths.

    For Python API users who build a ``Policy`` themselves: a bad model fails
    here, before any worker starts. The tokenizer is not checked (a ``Policy``
    is handed a tokenizer object).
    """
    from rlcore.training.checkpoint_files import outside_files

    checks = _Checks()
    for field, checkpoint in zip(fields, (weights_path, optimizer_path)):
        if checkpoint is not None and Path(checkpoint).is_dir():
            checks.problems += [f"{field}: {line}" for line in outside_files(checkpoint)]
    if checks.problems:
        return checks.problems
    if weights_path is not None and is_adapter_checkpoint(weights_path):
        checks.model("policy.model_name", policy.model_name)  # the adapters go over the base model
        checks.problems += _adapter_problems(Path(weights_path), policy.lora)
    elif weights_path is not None:
        checks.model(fields[0], str(weights_path))
    else:
        checks.model("policy.model_name", policy.model_name)
    return checks.problems


def _adapter_problems(directory: Path, lora: LoRAConfig) -> list[str]:
    """A LoRA checkpoint (PEFT adapter directory) that ``policy.lora`` cannot load, one line per problem."""
    if not lora.enabled:
        return [
            f"weights_path: {directory} is a LoRA adapter checkpoint, but policy.lora.enabled is false; "
            "enable policy.lora with the settings it was trained with, or pass a full model directory"
        ]
    adapter, problem = _read_json(directory / ADAPTER_CONFIG_NAME)
    if problem:
        return [f"weights_path: {problem}"]
    weights = directory / ADAPTER_WEIGHTS_NAME
    if not weights.is_file():
        return [
            f"weights_path: {directory} has {ADAPTER_CONFIG_NAME} but no {ADAPTER_WEIGHTS_NAME}; "
            "the checkpoint is incomplete, resume from an earlier one"
        ]
    if problem := _safetensors_problem(weights):
        return [f"weights_path: {problem}"]
    saved = {"dim": adapter.get("r"), "alpha": adapter.get("lora_alpha")}
    wanted = {"dim": lora.dim, "alpha": lora.alpha}
    if saved != wanted:
        return [
            f"weights_path: the adapter was trained with {saved}, but policy.lora has {wanted}; "
            "set policy.lora to the adapter's settings"
        ]
    return []


class _Checks:
    """Collects problem lines, checking each directory once whichever fields name it."""

    def __init__(self) -> None:
        self.problems: list[str] = []
        self._located: dict[str, Path | None] = {}
        self._done: set[tuple[str, str]] = set()

    def _locate(self, field: str, name: str) -> Path | None:
        if name not in self._located:
            directory, problem = _locate(field, name)
            if problem:
                self.problems.append(f"{field}: {problem}")
            self._located[name] = directory
        return self._located[name]

    def _first_time(self, name: str, kind: str) -> bool:
        if (name, kind) in self._done:
            return False
        self._done.add((name, kind))
        return True

    def model(self, field: str, name: str, weights: bool = True) -> None:
        directory = self._locate(field, name)
        if directory is None or not self._first_time(name, "model"):
            return
        if problem := _config_problem(directory, field):
            self.problems.append(f"{field}: {problem}")
        elif weights:
            self.problems += [f"{field}: {line}" for line in _weights_problems(directory)]

    def tokenizer(self, field: str, name: str, shared: str = "") -> None:
        directory = self._locate(field, name)
        if directory is None or not self._first_time(name, "tokenizer"):
            return
        if problem := _tokenizer_problem(directory):
            self.problems.append(
                f"{field}: {directory}{shared} {problem}; save the tokenizer there "
                f"(tokenizer.save_pretrained) or set {field} to a directory that has one"
            )


# --------------------------------------------------------------------------- where the files are


def _locate(field: str, name: str) -> tuple[Path | None, str | None]:
    """The local directory ``name`` stands for, or why there is none; (None, None) when a download may supply it."""
    path = Path(name)
    if path.is_dir():
        return path, None
    if path.exists():
        return None, f"{name} is a file; set {field} to the directory that holds it ({path.parent})"
    if name.startswith("~") and path.expanduser().exists():
        return None, f"{name}: '~' is not expanded; write the full path {path.expanduser()}"
    if (close := builtin_near_miss(name)) is not None:
        return None, (
            f"{name} is neither a local directory nor a model rlcore builds; did you mean '{close}'? (the models "
            "rlcore builds locally are in docs/models.md; a hub model is named org/name)"
        )
    if is_hub_id(name):
        return _locate_in_hub_cache(field, name)
    return None, (
        f"{name} does not exist (set {field} to a local Hugging Face model directory, "
        "or a hub name downloaded into the local cache)"
    )


def builtin_near_miss(name: str) -> str | None:
    """The built-in model (``tiny-llama``, ``qwen3-0.6b``, ...) ``name`` looks like a misspelling of, when it is
    no path and has no ``org/`` part; None otherwise (asked of the hub instead, ``hf download tiny-lama`` would
    have been the advice)."""
    import difflib

    from rlcore.models import BUILTIN_MODELS

    if "/" in name or name in BUILTIN_MODELS or Path(name).exists():
        return None
    close = difflib.get_close_matches(name.lower(), list(BUILTIN_MODELS), n=1, cutoff=0.8)
    return close[0] if close else None


def is_hub_id(name: str) -> bool:
    """Whether ``name`` has the shape of a Hugging Face hub repository id (it may still be a local path)."""
    return bool(_HUB_ID.match(name)) and ".." not in name


def hub_offline() -> bool:
    """Whether transformers will refuse to download (read at call time, as fresh worker processes read it)."""
    flags = (os.environ.get(var, "") for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    return any(flag.strip().upper() in {"1", "ON", "YES", "TRUE"} for flag in flags)


def _locate_in_hub_cache(field: str, name: str) -> tuple[Path | None, str | None]:
    """A hub name: its cached snapshot directory when offline; online, the workers may download it."""
    if not hub_offline():
        return None, None
    from huggingface_hub import constants, try_to_load_from_cache

    for filename in HUB_CACHE_FILES:
        found = try_to_load_from_cache(name, filename)
        if isinstance(found, str):
            return Path(found).parent, None
    return None, (
        f"{name} is not a local directory and not in the Hugging Face cache ({constants.HF_HUB_CACHE}), "
        f"and HF_HUB_OFFLINE is set: download it first (hf download {name}) "
        f"or set {field} to a local model directory"
    )


# --------------------------------------------------------------------------- config.json


def _read_json(path: Path) -> tuple[Any, str | None]:
    """Parsed JSON, or why it could not be read."""
    try:
        return json.loads(path.read_bytes()), None
    except OSError as exc:
        return None, f"{path} cannot be read ({exc.strerror or exc})"
    except (UnicodeDecodeError, ValueError) as exc:
        return None, f"{path} is not valid JSON ({exc}); {_RESAVE}"


def _config_problem(directory: Path, field: str) -> str | None:
    """transformers needs ``config.json`` with a model type to build the model."""
    path = directory / CONFIG_NAME
    if not path.is_file():
        return (
            f"{directory} has no {CONFIG_NAME}, so it is not a Hugging Face model directory "
            f"(set {field} to the directory save_pretrained wrote)"
        )
    data, problem = _read_json(path)
    if problem:
        return problem
    if not isinstance(data, dict) or not (data.get("model_type") or data.get("architectures")):
        return f'{path} has neither "model_type" nor "architectures", so no model class fits it; {_RESAVE}'
    return None


# --------------------------------------------------------------------------- tokenizer


def _tokenizer_problem(directory: Path) -> str | None:
    """AutoTokenizer needs tokenizer.json, or a vocabulary file plus a config naming the tokenizer class."""
    fast = directory / "tokenizer.json"
    if fast.is_file():
        return None if fast.stat().st_size else "has an empty tokenizer.json"
    vocab = [name for name in _VOCAB_FILES if (directory / name).is_file()]
    has_tokenizer_config = (directory / "tokenizer_config.json").is_file()
    if vocab and (has_tokenizer_config or (directory / CONFIG_NAME).is_file()):
        return None
    if has_tokenizer_config:
        return (
            "has tokenizer_config.json but no vocabulary file "
            "(tokenizer.json, tokenizer.model, vocab.json or vocab.txt)"
        )
    if vocab:
        return f"has {vocab[0]} but no tokenizer_config.json naming the tokenizer class"
    return (
        "has no tokenizer files (tokenizer.json, or tokenizer_config.json with a vocabulary file "
        "such as tokenizer.model or vocab.json)"
    )


# --------------------------------------------------------------------------- weights


def _engine_loads_weights(gen: GenerationConfig) -> bool:
    """False when the generation engine starts with random weights (``load_format: dummy``) and waits for a refit."""
    section = gen.backend_sections.get(f"{gen.backend}_cfg") or {}
    return section.get("load_format") != "dummy"


def _weights_problems(directory: Path) -> list[str]:
    """safetensors weights, single file or sharded, whose headers agree with the file sizes."""
    index = directory / SAFE_WEIGHTS_INDEX_NAME
    if index.is_file():
        shards, problems = _index_shards(index)
        return problems + [p for shard in shards if (p := _safetensors_problem(shard))]
    single = directory / SAFE_WEIGHTS_NAME
    if single.is_file():
        return [p] if (p := _safetensors_problem(single)) else []
    if (directory / PICKLE_WEIGHTS_NAME).is_file() or (directory / PICKLE_WEIGHTS_INDEX_NAME).is_file():
        return _pickle_weights_problems(directory)
    return [
        f"{directory} has no weights (expected {SAFE_WEIGHTS_NAME}, "
        f"or {SAFE_WEIGHTS_INDEX_NAME} with its shards); {_RESAVE}"
    ]


def _index_shards(index: Path) -> tuple[list[Path], list[str]]:
    """The shard files an index lists that exist, and a line naming those that do not."""
    data, problem = _read_json(index)
    if problem:
        return [], [problem]
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        return [], [f'{index} has no "weight_map"; {_RESAVE}']
    shards = [index.parent / name for name in sorted(set(map(str, weight_map.values())))]
    missing = [shard.name for shard in shards if not shard.is_file()]
    if not missing:
        return shards, []
    more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
    line = f"{index} lists {len(missing)} shard file(s) that are missing: {', '.join(missing[:3])}{more}; {_RESAVE}"
    return [shard for shard in shards if shard.is_file()], [line]


def _pickle_weights_problems(directory: Path) -> list[str]:
    """``pytorch_model.bin``, which transformers loads (a backend that cannot, megatron, says so in its own
    config check)."""
    index = directory / PICKLE_WEIGHTS_INDEX_NAME
    if index.is_file():
        shards, problems = _index_shards(index)
    else:
        shards, problems = [directory / PICKLE_WEIGHTS_NAME], []
    return problems + [p for shard in shards if (p := _zip_problem(shard) or _pickle_problem(shard))]


def _pickle_problem(path: Path) -> str | None:
    """What the workers' weights-only reader refuses in a pickled weights file, found here and said in rlcore's
    words (transformers' own refusal repeats torch's advice to turn ``weights_only`` off)."""
    import zipfile

    from rlcore.safe_pickle import UnsafeCheckpointError, torch_load

    try:
        torch_load(str(path), str(path), mmap=zipfile.is_zipfile(path))  # tensors mapped, not read
    except UnsafeCheckpointError as exc:
        return f"{exc}: pickled weights that name code are never loaded; use safetensors weights"
    except Exception as exc:  # noqa: BLE001 - whatever a damaged file raises, it is one line
        detail = (str(exc).splitlines() or ["no detail"])[0][:120]
        return f"{path} cannot be read as torch weights ({type(exc).__name__}: {detail}); {_RESAVE}"
    return None


def _zip_problem(path: Path) -> str | None:
    """A torch zip archive whose central directory (at the end) is gone was truncated."""
    import zipfile

    with path.open("rb") as f:
        if f.read(2) != b"PK":
            return None  # the legacy (non-zip) torch format: nothing cheap to check
    try:
        zipfile.ZipFile(path).close()
    except (zipfile.BadZipFile, OSError) as exc:
        return f"{path} is truncated or corrupted ({exc}); {_RESAVE}"
    return None


def _safetensors_problem(path: Path) -> str | None:
    """Reads only the header: its length, its JSON, each tensor's extent, and the file size they imply."""
    size = path.stat().st_size
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            return f"{path} is truncated ({size} bytes, less than a safetensors header); {_RESAVE}"
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > min(size - 8, _MAX_HEADER_BYTES):
            return (
                f"{path} has a corrupted safetensors header (it claims {header_len:,} header bytes "
                f"in a {size:,}-byte file); {_RESAVE}"
            )
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        return f"{path} has a corrupted safetensors header (not valid JSON: {exc}); {_RESAVE}"
    if not isinstance(header, dict):
        return f"{path} has a corrupted safetensors header (not a JSON object); {_RESAVE}"
    data_end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if why := _tensor_entry_problem(name, info):
            return f"{path} has a corrupted safetensors header ({why}); {_RESAVE}"
        data_end = max(data_end, info["data_offsets"][1])
    expected = 8 + header_len + data_end
    if size < expected:
        return f"{path} is truncated ({size:,} bytes; its header describes {expected:,}); {_RESAVE}"
    if size > expected:
        return (
            f"{path} has {size - expected:,} unexpected bytes after the last tensor "
            f"({size:,} bytes; its header describes {expected:,}); {_RESAVE}"
        )
    return None


def _tensor_entry_problem(name: str, info: Any) -> str | None:
    """Why one header entry cannot describe a tensor (dtype, shape, byte range), or None."""
    if not isinstance(info, dict):
        return f"tensor {name!r} has no description"
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in SAFETENSORS_DTYPE_BITS:
        return f"tensor {name!r} has unknown dtype {dtype!r}"
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        return f"tensor {name!r} has an invalid shape {shape!r}"
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        return f"tensor {name!r} has invalid data_offsets {offsets!r}"
    numel = 1
    for dim in shape:
        numel *= dim
    needed = -(-numel * SAFETENSORS_DTYPE_BITS[dtype] // 8)
    if offsets[1] - offsets[0] != needed:
        return (
            f"tensor {name!r} ({dtype} {shape}) needs {needed:,} bytes "
            f"but data_offsets span {offsets[1] - offsets[0]:,}"
        )
    return None
