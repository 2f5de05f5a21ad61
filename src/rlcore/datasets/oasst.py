"""OpenAssistant's conversation trees (``format: oasst``) as message logs, as NeMo-RL's ``open_assistant`` reads them.

The hub dataset (``OpenAssistant/oasst1``) holds one JSON tree per line in ``2023-04-12_oasst_all.trees.jsonl.gz``
(``data_files`` names another file of the same layout). Every path from a tree's root prompt to a leaf is one
conversation: NeMo-RL's system prompt, then the turns (``prompter`` as user, ``assistant``); a conversation of one
turn is dropped. The conversations are written once into ``datasets``' cache as Arrow and read memory-mapped.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from typing import Any

from rlcore.datasets.files import DataError

TREES_FILE = "2023-04-12_oasst_all.trees.jsonl.gz"
#: NeMo-RL's system prompt of every OpenAssistant conversation.
SYSTEM_PROMPT = (
    "A chat between a curious user and an artificial intelligence assistant. The assistant gives "
    "helpful, detailed, and polite answers to the user's questions.\n\n"
)
_ROLES = {"prompter": "user", "assistant": "assistant"}


def conversations(node: dict[str, Any]) -> list[list[dict[str, str]]]:
    """Every conversation from ``node`` (a tree's ``prompt``, or a reply) down to a leaf, without the system prompt."""
    if node.get("role") not in _ROLES:
        raise ValueError(f"unknown role {node.get('role')!r}")
    turn = {"role": _ROLES[node["role"]], "content": node["text"]}
    below = [log for reply in node.get("replies") or [] for log in conversations(reply)]
    return [[turn, *log] for log in below] or [[turn]]


def tree_conversations(path: str, stamp: Any = None) -> Iterator[dict[str, Any]]:
    """The rows (``messages``) of a trees file, in NeMo-RL's order (``stamp``: the file's size and time, so that
    ``datasets``' cache, keyed by the arguments, holds one copy per version of the file)."""
    with gzip.open(path, "rt", encoding="utf-8") if path.endswith(".gz") else open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            tree = json.loads(line)
            if "prompt" not in tree:
                continue
            for log in conversations(tree["prompt"]):
                if len(log) >= 2:
                    yield {"messages": [{"role": "system", "content": SYSTEM_PROMPT}, *log]}


def read_oasst_rows(cfg: Any, key: str = "data.train.hub_id") -> Any:
    """The conversations of ``cfg``'s trees file (its hub dataset's, or its local ``path``) as a memory-mapped
    ``datasets.Dataset``."""
    from huggingface_hub import hf_hub_download

    from rlcore.datasets.caches import hub_cache_dir
    from rlcore.datasets.hub import missing_line, offline

    files = cfg.data_files if isinstance(cfg.data_files, str) else TREES_FILE
    if cfg.path is not None:  # a local copy of the trees file
        return _conversations_dataset(str(cfg.path), f"{key.rpartition('.')[0]}.path")
    try:
        path = hf_hub_download(
            cfg.hub_id,
            files,
            repo_type="dataset",
            revision=cfg.revision,
            local_files_only=offline(),
            cache_dir=hub_cache_dir(),
        )
    except Exception as exc:  # noqa: BLE001 - not cached offline, or the hub refused: one line either way
        if offline():
            raise DataError(missing_line(key, cfg.hub_id, cfg.revision)) from None
        raise DataError(f"{key}: cannot download {files} of {cfg.hub_id}: {' '.join(str(exc).split())[:300]}") from None
    return _conversations_dataset(path, key)


def _conversations_dataset(path: str, key: str) -> Any:
    import datasets

    from rlcore.datasets.caches import datasets_cache_dir

    datasets.disable_progress_bars()
    try:
        return datasets.Dataset.from_generator(
            tree_conversations, gen_kwargs={"path": path, "stamp": _stamp(path)}, cache_dir=datasets_cache_dir()
        )
    except Exception as exc:  # noqa: BLE001
        raise DataError(f"{key}: {path}: not OpenAssistant trees ({' '.join(str(exc).split())[:300]})") from None


def _stamp(path: str) -> tuple[int, float]:
    import os

    st = os.stat(path)
    return st.st_size, st.st_mtime
