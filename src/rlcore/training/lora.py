"""LoRA adapters on a Hugging Face causal LM, named the way PEFT names them.

A small in-house layer instead of ``peft.get_peft_model``, for three reasons:
tensor parallel needs to shard ``lora_A``/``lora_B`` with the same parallel
styles as the base layer (``rl_dtensor.tp_plans.with_lora``), which PEFT's wrapper
classes do not expose to ``parallelize_module``; the reference model is the
base model with the adapters switched off, a flag here; and the backends read
full tensors by name for refit and checkpoints, which stay plain here:

- ``<path>.base_layer.weight`` (frozen) is the Hugging Face ``<path>.weight``;
- ``<path>.lora_A.weight`` ``[r, in]`` and ``<path>.lora_B.weight`` ``[out, r]``
  are saved as ``base_model.model.<path>.lora_A.weight`` (PEFT's adapter
  format, loadable with ``peft.PeftModel.from_pretrained``).

The adapter adds ``(alpha / r) * B(A(x))`` to the base layer's output, so the
merged weight is ``W + (alpha / r) * B @ A``.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import math
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rlcore.training.checkpoint import ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME

BASE = ".base_layer."
PEFT_PREFIX = "base_model.model."


class LoRALinear(nn.Module):
    """``base_layer(x) + scaling * lora_B(lora_A(x))``, with dropout before A ('pre') or after B ('post')."""

    def __init__(
        self,
        base: nn.Linear,
        dim: int,
        alpha: float,
        dropout: float = 0.0,
        dropout_position: str = "post",
        a_init: str = "xavier",
    ) -> None:
        super().__init__()
        self.base_layer = base
        factory = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_A = nn.Linear(base.in_features, dim, bias=False, **factory)
        self.lora_B = nn.Linear(dim, base.out_features, bias=False, **factory)
        self.scaling = alpha / dim
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.dropout_position = dropout_position
        self.active = True
        with torch.no_grad():
            if a_init == "xavier":
                nn.init.xavier_normal_(self.lora_A.weight)
            else:
                nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
            nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base_layer(x)
        if not self.active:
            return out
        if self.dropout_position == "pre":
            return out + self.lora_B(self.lora_A(self.dropout(x))) * self.scaling
        return out + self.dropout(self.lora_B(self.lora_A(x))) * self.scaling


def _matches(path: str, patterns: Iterable[str]) -> bool:
    leaf = path.rsplit(".", 1)[-1]
    return any(p == leaf or p == path or fnmatch.fnmatchcase(path, p) for p in patterns)


def select_targets(model: nn.Module, cfg: Any) -> list[str]:
    """Dotted paths of the ``nn.Linear`` layers ``cfg`` (``policy.lora``) adapts, in module order.

    ``match_all_linear`` takes every linear layer inside the decoder blocks
    (paths with ``.layers.<i>.``). The LM head is adapted only when
    ``target_modules`` names it: with a frozen output layer, a change of the
    hidden states alone can move each token's logit only so far (what a new
    output vocabulary, or a randomly initialised model, needs). Embeddings are
    never adapted.
    """
    head = _lm_head_path(model)
    found = []
    for path, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        if path == head:
            wanted = _matches(path, cfg.target_modules)
        elif ".layers." in f".{path}":
            wanted = cfg.match_all_linear or _matches(path, cfg.target_modules)
        else:
            wanted = False
        if wanted and not _matches(path, cfg.exclude_modules):
            found.append(path)
    if head in found and getattr(model.config, "tie_word_embeddings", False):
        raise ValueError(
            f"policy.lora.target_modules: names the LM head ({head!r}), but this model ties it to the "
            "input embeddings, so a merged adapter would change the embeddings too; leave it out"
        )
    if not found:
        raise ValueError(
            f"policy.lora: no linear layer of the model matches target_modules={cfg.target_modules} "
            f"(exclude_modules={cfg.exclude_modules}); use the layers' own names, e.g. q_proj"
        )
    return found


def _lm_head_path(model: nn.Module) -> str | None:
    """The dotted path of the model's output layer (``lm_head`` for Hugging Face causal LMs)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return next((path for path, module in model.named_modules() if module is head), None) if head else None


def apply_lora(model: nn.Module, cfg: Any, seed: int = 0) -> list[str]:
    """Replace the targeted linear layers by :class:`LoRALinear` and freeze everything but the adapters.

    Adapter initialisation draws from a generator seeded with ``seed``, so every
    rank (and a resumed run) starts from the same A. Returns the adapted paths.
    """
    targets = select_targets(model, cfg)
    for p in model.parameters():
        p.requires_grad_(False)
    rng_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        for path in targets:
            parent_path, _, leaf = path.rpartition(".")
            parent = model.get_submodule(parent_path)
            setattr(
                parent,
                leaf,
                LoRALinear(
                    getattr(parent, leaf), cfg.dim, cfg.alpha, cfg.dropout, cfg.dropout_position, cfg.lora_A_init
                ),
            )
    finally:
        torch.random.set_rng_state(rng_state)
    return targets


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    return {path: m for path, m in model.named_modules() if isinstance(m, LoRALinear)}


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The base model: every adapter switched off inside the block (the reference policy)."""
    layers = list(lora_layers(model).values())
    for layer in layers:
        layer.active = False
    try:
        yield
    finally:
        for layer in layers:
            layer.active = True


# -- names ---------------------------------------------------------------------------------


def is_adapter_name(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def hf_name(name: str) -> str:
    """The Hugging Face name of a base weight (``x.base_layer.weight`` → ``x.weight``)."""
    return name.replace(BASE, ".")


def layer_path(name: str) -> str:
    """The adapted layer's path of an adapter or base tensor name (``x.lora_A.weight`` → ``x``)."""
    for part in (".lora_A.", ".lora_B.", BASE):
        if part in name:
            return name.split(part, 1)[0]
    return name.rsplit(".", 1)[0]


# -- merged views (refit, merged checkpoints) ------------------------------------------------


def merged_weight(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """``W + scaling * B @ A``, computed in float32, returned in ``base``'s dtype."""
    delta = (b.float() @ a.float()) * scaling
    return (base.float() + delta).to(base.dtype)


#: Layers an engine fuses into one parameter (vLLM's ``qkv_proj``, ``gate_up_proj``): a refit that
#: sends one of them sends all, or the engine would rebuild the fused weight from a part.
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def changed_layers(targets: Iterable[str]) -> set[str]:
    """The layer paths a refit after the first sends: the adapted ones, widened to whole fused groups."""
    out = set()
    for path in targets:
        parent, _, leaf = path.rpartition(".")
        group = next((g for g in FUSED_GROUPS if leaf in g), (leaf,))
        out.update(f"{parent}.{member}" if parent else member for member in group)
    return out


def _is_base_weight(name: str) -> bool:
    return name.endswith(BASE + "weight")


def merge_stream(
    named: Iterable[tuple[str, torch.Tensor]], scaling: float, only_layers: set[str] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Turn a stream of model tensors (base, lora_A, lora_B per adapted layer) into Hugging Face tensors.

    Each adapted layer becomes one merged ``<path>.weight`` once its three
    tensors have passed (a base bias passes under its HF name); other tensors
    pass unchanged. With ``only_layers`` (a refit after the first), tensors of
    other layers are dropped.
    """
    held: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in named:
        path = layer_path(name)
        if only_layers is not None and path not in only_layers:
            continue
        if BASE not in name and not is_adapter_name(name):
            yield name, tensor
            continue
        # An adapted layer's tensors arrive as base weight (, base bias), lora_A, lora_B: hold them
        # until lora_B, then emit the merged weight and the rest in the order they came.
        parts = held.setdefault(path, [])
        parts.append((name, tensor))
        if ".lora_B." in name:
            del held[path]
            named_parts = dict(parts)
            weight = merged_weight(
                named_parts[path + BASE + "weight"], named_parts[path + ".lora_A.weight"], tensor, scaling
            )
            yield path + ".weight", weight
            yield from ((hf_name(n), t) for n, t in parts if BASE in n and not _is_base_weight(n))
    if held:
        raise RuntimeError(f"merge_stream: incomplete adapted layers {sorted(held)[:3]}")


def merged_metadata(metadata: dict[str, Any], only_layers: set[str] | None = None) -> dict[str, Any]:
    """The refit metadata ``{name: (shape, dtype)}`` of :func:`merge_stream`'s output, in its order."""
    return {
        hf_name(name): meta
        for name, meta in metadata.items()
        if not is_adapter_name(name) and (only_layers is None or layer_path(name) in only_layers)
    }


# -- PEFT-format adapter files ---------------------------------------------------------------


def peft_adapter_config(cfg: Any, targets: list[str], base_model: str) -> dict[str, Any]:
    """``adapter_config.json`` for :func:`save_lora_checkpoint` (what ``peft.LoraConfig`` reads)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": cfg.dim,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "bias": "none",
        "target_modules": list(targets),  # full paths: PEFT adapts exactly these layers
        "fan_in_fan_out": False,
        "inference_mode": True,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
    }


MERGED_DIR = "merged"


def save_lora_checkpoint(
    adapters: dict[str, torch.Tensor],
    config: dict[str, Any],
    path: str | Path,
    merged: dict[str, torch.Tensor] | None = None,
    hf_config: Any = None,
) -> None:
    """Write the adapters (``{model name: tensor}``) in PEFT's format, atomically (safetensors, no pickle).

    With ``merged`` (full Hugging Face tensors), ``<path>/merged`` is also a
    model directory ``AutoModelForCausalLM.from_pretrained`` loads.
    """
    from safetensors.torch import save_file

    from rlcore.training.checkpoint import atomic_directory, write_hf_files

    peft_tensors = {PEFT_PREFIX + name: t.detach().to("cpu").contiguous() for name, t in adapters.items()}
    with atomic_directory(path) as tmp:
        save_file(peft_tensors, str(tmp / ADAPTER_WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / ADAPTER_CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
        if merged is not None:
            (tmp / MERGED_DIR).mkdir()
            write_hf_files(merged, hf_config, tmp / MERGED_DIR)


def load_adapter(path: str | Path) -> dict[str, torch.Tensor]:
    """The adapter tensors of a PEFT adapter directory, under this module's model names."""
    from safetensors.torch import load_file

    from rlcore.training.checkpoint_files import check_inside

    check_inside(path)
    tensors = load_file(str(Path(path) / ADAPTER_WEIGHTS_NAME))
    out = {}
    for name, t in tensors.items():
        name = name.removeprefix(PEFT_PREFIX)
        out[name.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")] = t
    return out


def load_adapter_into(model: nn.Module, path: str | Path) -> None:
    """Copy a PEFT adapter directory's tensors into a LoRA-wrapped plain model (before any sharding).

    The adapted layers must be the same: an adapter tensor the model lacks, or
    an adapter of the model the checkpoint lacks, raises naming it.
    """
    adapters = load_adapter(path)
    ours = {name for name, _ in model.named_parameters() if is_adapter_name(name)}
    if set(adapters) != ours:
        raise KeyError(
            f"{path}: the adapter does not fit policy.lora's layers: missing "
            f"{sorted(ours - set(adapters))[:3]}, unexpected {sorted(set(adapters) - ours)[:3]}"
        )
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in adapters.items():
            params[name].copy_(tensor)
