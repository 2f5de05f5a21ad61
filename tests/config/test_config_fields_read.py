"""No silent no-op field: every field of every config model is read somewhere outside the schema.

The walk covers the core schema (``RLCoreConfig`` and every model under it) and
the config class of every installed backend plugin. A field counts as read
where the runtime code (``src/rlcore`` and ``plugins/*/src``, without the
schema modules themselves, the NeMo-RL reader and the test kit) loads it as an
attribute (``cfg.field``), a string key (``cfg["field"]``, ``.get("field")``,
``getattr(cfg, "field")``) — so a value that is accepted and then never looked
at fails this test.

Matching is by name, not by class (``enabled`` read anywhere counts for every
``enabled``): a floor, not a proof. Fields read only to fill in another
field's default, or on purpose only by conversion, are in ``ALLOWED`` with the
reason.
"""

from __future__ import annotations

import ast
import typing
from pathlib import Path

from pydantic import BaseModel

from rlcore.config import RLCoreConfig
from rlcore.config.base import SECTIONS_FIELD
from rlcore.plugins import get_registry

REPO = Path(__file__).resolve().parents[2]
SCHEMA_MODULES = {"base.py", "cluster.py", "checkpointing.py", "generation.py", "policy.py", "schemas.py"}
#: The algorithms' schema modules (their sections and the sections they own), outside ``src/rlcore/config``.
ALGORITHM_SCHEMA_MODULES = {("grpo", "config.py"), ("grpo", "loss_config.py")}
#: Functions that read a setting named by their second argument: ``getattr(cfg, "x")``,
#: ``loop_setting(cfg, "x", default)`` (an algorithm section's setting, when it has one).
NAMED_GETTERS = ("getattr", "hasattr", "loop_setting")

#: ``Model.field`` -> why it needs no read site of its own.
ALLOWED: dict[str, str] = {
    "SectionsModel.backend_sections": "the container of '*_cfg' sub-sections: read by the plugin registry "
    "through getattr(owner, 'backend_sections')",
    "AsyncPPOConfig.drop_incomplete_targets_on_restore": "NeMo-RL's key of asynchronous PPO, which "
    "ppo.async_ppo.enabled: true asks for and PPO.resolve refuses; with it false the key does nothing, as in NeMo-RL",
    "VllmConfig.pipeline_parallel_size": "NeMo-RL's key, accepted at 1 only: its field validator refuses more (each "
    "engine rank holds every layer; tensor_parallel_size splits a model)",
}


def _models() -> list[type[BaseModel]]:
    found: list[type[BaseModel]] = []

    def visit(tp: typing.Any) -> None:
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            if tp in found:
                return
            found.append(tp)
            for f in tp.model_fields.values():
                visit(f.annotation)
            return
        for arg in typing.get_args(tp):
            visit(arg)

    visit(RLCoreConfig)
    for record in get_registry().records:
        spec = record.spec
        if spec is not None and getattr(spec, "config_class", None):  # a tool-call parser's spec has none
            visit(spec.load_config_class())
        for key in getattr(spec, "sections", None) or {}:  # an algorithm's other top-level sections (GRPO's loss)
            visit(spec.load_section_class(key))
    return found


def _runtime_sources() -> list[Path]:
    files = [
        p
        for p in (REPO / "src" / "rlcore").rglob("*.py")
        if not (p.parent.name == "config" and p.name in SCHEMA_MODULES)
        and (p.parent.name, p.name) not in ALGORITHM_SCHEMA_MODULES
        and "nemo_rl" not in p.parts
        and "testing" not in p.parts
    ]
    for plugin in sorted((REPO / "plugins").glob("*/src")):
        files += [p for p in plugin.rglob("*.py") if not p.name.endswith("config.py") or "rl_megatron" in p.parts]
    return files


def _read_names() -> set[str]:
    names: set[str] = set()
    for path in _runtime_sources():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                names.add(node.attr)
            elif (
                isinstance(node, ast.Subscript)
                and isinstance(node.slice, ast.Constant)
                and isinstance(node.slice.value, str)
            ):
                names.add(node.slice.value)
            elif isinstance(node, ast.Call) and node.args:
                fn = node.func
                getter = (isinstance(fn, ast.Attribute) and fn.attr == "get") or (
                    isinstance(fn, ast.Name) and fn.id in NAMED_GETTERS
                )
                key = node.args[1] if isinstance(fn, ast.Name) and len(node.args) > 1 else node.args[0]
                if getter and isinstance(key, ast.Constant) and isinstance(key.value, str):
                    names.add(key.value)
    return names


def test_every_config_field_is_read_somewhere() -> None:
    read = _read_names()
    unread = []
    for model in _models():
        for name in model.model_fields:
            owners = [f"{c.__name__}.{name}" for c in model.__mro__ if f"{c.__name__}.{name}" in ALLOWED]
            if name not in read and not owners and name != SECTIONS_FIELD:
                unread.append(f"{model.__module__}.{model.__name__}.{name}")
    assert not unread, (
        "config fields no runtime code reads (implement them, reject non-default values in a "
        "rule, or add them to ALLOWED with the reason):\n" + "\n".join(unread)
    )


def test_the_walk_sees_the_plugins_and_would_catch_a_new_field() -> None:
    models = {m.__name__ for m in _models()}
    assert {"PolicyConfig", "MegatronDDPConfig", "ClippedPGLossConfig", "GRPOConfig"} <= models
    if any(r.name == "vllm" and r.spec is not None for r in get_registry().records):
        assert "VllmConfig" in models
    assert "surely_nobody_reads_this_field" not in _read_names()
