"""NeMo-RL's on-policy distillation configs as rlcore's: a ``distillation`` section without a ``grpo`` one.

NeMo-RL's distillation (``examples/run_distillation.py``) reads ``distillation``, ``loss_fn``, ``policy``
(the student, with its ``generation``), ``teacher``, ``data``, ``env``, ``checkpointing``, ``logger`` and
``cluster``. The ``distillation`` keys map by the table (same names; absent ones take NeMo-RL's defaults),
and so do the loss's (``loss_fn.kl_type``, ``mixed_kl_weight``, ``zero_outside_topk`` → ``distillation.*``);
other ``loss_fn`` keys (a GRPO loss a ``defaults:`` chain brings) are not read by NeMo-RL's distillation loss
and are dropped as ignored. Policy, generation, data, env, cluster and checkpointing convert as a GRPO
config's.

The teacher: a Policy of its own settings. Its model is ``teacher.model_name`` →
``distillation.teacher_model_name``; the rest of ``teacher`` (NeMo-RL's examples copy the student's policy with
a YAML anchor) is converted as ``policy`` is and compared with the student's: the same values are the student's
already, each other one is the teacher's own, under ``distillation.teacher`` (its parallel layout, precision,
batch sizes). Its
``generation``, ``optimizer`` and ``scheduler`` are ignored (NeMo-RL's teacher generates nothing and is built
without an optimizer), and so is ``tokenizer.name``, whatever it names: NeMo-RL's on-policy distillation builds
the teacher with the student's tokenizer and checks that the teacher model's vocabulary is the student's
(``check_vocab_equality``); rlcore checks the same when the run starts. A teacher of another vocabulary is
rlcore's ``distillation.teacher.tokenizer.name`` (cross-tokenizer distillation), which no NeMo-RL on-policy key
means. NeMo-RL's own cross-tokenizer path is another algorithm (off-policy, ``teachers`` with a projection matrix
each), refused by the table.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlcore.nemo_rl.conversion import Conversion, algorithm, nemo_defaults, put, without_unread
from rlcore.nemo_rl.second_policy import own_settings

#: NeMo-RL's defaults of ``distillation`` keys (its DistillationConfig, main) where rlcore's differ.
NEMO_DEFAULTS = {
    "num_prompts_per_step": 128,
    "max_num_steps": 1000,
    "max_num_epochs": 10,
    "val_batch_size": 64,
    "val_period": 20,
    "max_val_samples": 512,
    "seed": 42,
}
#: The ``loss_fn`` keys NeMo-RL's distillation loss reads (DistillationLossConfig).
LOSS_KEYS = ("kl_type", "mixed_kl_weight", "zero_outside_topk")
#: The teacher's keys NeMo-RL does not read, with why.
TEACHER_UNREAD = {
    "generation": "NeMo-RL's teacher generates nothing: the student does, with policy.generation",
    "optimizer": "NeMo-RL builds the teacher without an optimizer: it does not train",
    "scheduler": "NeMo-RL builds the teacher without an optimizer: it does not train",
}
_MISSING = object()


def without_unread_loss_keys(nemo: dict[str, Any], out: Conversion) -> dict[str, Any]:
    """``nemo`` without the ``loss_fn`` keys NeMo-RL's distillation loss does not read, each listed as ignored."""
    loss = nemo.get("loss_fn")
    if not isinstance(loss, dict):
        return nemo
    why = f"NeMo-RL's distillation loss reads only {', '.join(LOSS_KEYS)}"
    return without_unread(nemo, out, {f"loss_fn.{key}": why for key in loss if key not in LOSS_KEYS})


def distillation_settings(nemo: dict[str, Any], out: Conversion) -> None:
    """A distillation config's absent ``distillation`` keys (NeMo-RL's defaults where they differ from rlcore's)."""
    if algorithm(nemo) != "distillation":
        return
    nemo_defaults(nemo, out, "distillation", NEMO_DEFAULTS)


def teacher(nemo: dict[str, Any], out: Conversion, convert: Callable[[dict[str, Any]], Conversion]) -> None:
    """``teacher`` (see the module's docstring); in another algorithm's config it is not read. ``convert``: the
    table's walker (:func:`rlcore.nemo_rl.convert.convert`, passed in: it imports this module)."""
    section, algo = nemo.get("teacher", _MISSING), algorithm(nemo)
    if algo != "distillation":
        if section is not _MISSING:
            out.ignored.append(("teacher", f"only NeMo-RL's distillation reads it (this is a {algo} config)"))
        return
    model = section.get("model_name") if isinstance(section, dict) else None
    if model is None and nemo.get("teachers"):  # NeMo-RL's cross-tokenizer off-policy config: the table refuses it
        return
    if model is None:
        out.problems.append(
            "teacher.model_name: is missing; a distillation config names its teacher there "
            "(e.g. ++teacher.model_name=Qwen/Qwen3-4B)"
        )
        return
    put(out.config, "distillation.teacher_model_name", model)
    out.sources["distillation.teacher_model_name"] = "teacher.model_name"
    rest = {key: value for key, value in section.items() if key != "model_name"}
    for key, why in TEACHER_UNREAD.items():
        if rest.pop(key, _MISSING) is not _MISSING:
            out.ignored.append((f"teacher.{key}", why))
    _tokenizer(rest, out)
    own_settings(rest, out, convert, "distillation.teacher", "teacher")


def _tokenizer(rest: dict[str, Any], out: Conversion) -> None:
    """``teacher.tokenizer.name``, taken out of ``rest``: NeMo-RL does not read it (see the module's docstring)."""
    tok = rest.get("tokenizer")
    if not isinstance(tok, dict) or "name" not in tok:
        return
    rest["tokenizer"] = {key: value for key, value in tok.items() if key != "name"}
    out.ignored.append(
        (
            "teacher.tokenizer.name",
            "rlcore runs the teacher on the student's tokenizer, as NeMo-RL "
            "does, and refuses a teacher model of another vocabulary as NeMo-RL's check_vocab_equality "
            "does; distillation.teacher.tokenizer.name maps such a teacher instead",
        )
    )


__all__ = ["distillation_settings", "teacher", "without_unread_loss_keys"]
