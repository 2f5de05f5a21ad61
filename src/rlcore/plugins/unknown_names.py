"""What to say about a name no installed plugin registers: which names are installed, a close one, and where
the name comes from, naming a package only when it exists.

The registry knows installed plugins only. For a name that is not installed it still knows two things,
written down here and used for nothing but this message: the names rlcore's own plugin distributions provide
(each installed with one ``pip install``), and names that NeMo-RL configs use for engines rlcore ships no
plugin for (``sglang``, ``trtllm``), where the honest answer is "no package of ours provides it", not a guessed
``pip install rl-<name>``.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence

#: The backends rlcore's own plugin distributions provide, and the command that installs each.
FIRST_PARTY_BACKENDS: dict[str, tuple[str, str]] = {
    "dtensor": ("rl-dtensor", "pip install rl-dtensor"),
    "fsdp1": ("rl-fsdp1", "pip install rl-fsdp1"),
    "megatron": ("rl-megatron", "pip install rl-megatron"),
    "vllm": ("rl-vllm", "pip install 'rl-vllm[cpu]' (or 'rl-vllm[gpu]' on CUDA)"),
}

#: Backend names other frameworks' configs use (NeMo-RL's generation backends) that no rlcore plugin
#: provides, with what each is.
WITHOUT_A_PLUGIN: dict[str, str] = {
    "sglang": "SGLang, a generation engine",
    "trtllm": "TensorRT-LLM, a generation engine",
    "dynamo": "NVIDIA Dynamo, an inference serving framework",
}

#: Where to read about writing or finding a plugin of each kind, in rlcore's documentation.
DOCS = {"backend": "docs/plugin-api.md", "environment": "docs/tasks.md", "algorithm": "docs/algorithms.md"}

#: How alike a name must be to an installed one to be suggested: 'mathh' -> 'math' (0.89), not 'trtllm' ->
#: 'vllm' (0.6).
CLOSE = 0.7


def unknown_name_message(noun: str, name: str, installed: Sequence[str], failed: Sequence[str] = ()) -> str:
    """The one line for ``name`` (or ``distribution:name``), a ``noun`` (``backend``, ``environment``,
    ``algorithm``) no installed plugin registers; ``installed``: the names that are, ``failed``: plugins that
    failed to load (any of them may have provided it)."""
    line = f"no {noun} named '{name}' (installed: {', '.join(installed) or 'none'}); "
    line += what_to_do_about(noun, name, installed)
    if failed:
        line += f" (plugins that failed to load: {', '.join(failed)}; see 'rlcore {noun}s list')"
    return line


def what_to_do_about(noun: str, name: str, installed: Sequence[str]) -> str:
    """What to do about a ``noun`` named ``name`` that is not installed: the package that provides it when it is
    one of rlcore's own, what it is when no plugin provides it, a close installed name, or where to look."""
    short = name.rpartition(":")[2]
    listing = f"rlcore {noun}s list"
    if noun == "backend" and short in FIRST_PARTY_BACKENDS:
        distribution, command = FIRST_PARTY_BACKENDS[short]
        return f"'{short}' comes with rlcore's {distribution} distribution: {command}"
    if noun == "backend" and short in WITHOUT_A_PLUGIN:
        return (
            f"'{short}' is {WITHOUT_A_PLUGIN[short]} rlcore has no plugin for: choose an installed backend "
            f"({listing}), or install a third-party plugin that provides it ({DOCS[noun]} says how one registers)"
        )
    if close := difflib.get_close_matches(short, list(installed), n=1, cutoff=CLOSE):
        return f"did you mean '{close[0]}'?"
    return (
        f"no plugin rlcore knows of provides '{short}': choose an installed {noun} ({listing}), or install or "
        f"write the plugin that provides it ({DOCS.get(noun, DOCS['backend'])})"
    )
