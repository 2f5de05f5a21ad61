"""The layout tells the architecture: production code never imports the test kit, moved modules keep their old paths
(for one release, with a DeprecationWarning where the module itself moved); the layering is
tests/project/test_layers.py."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "rlcore"


def _imported_modules(path: Path) -> set[str]:
    """Every module an ``import`` / ``from ... import`` in ``path`` names (at any depth, absolute only)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_production_code_never_imports_the_test_kit():
    offenders = []
    for path in sorted(SRC.rglob("*.py")):
        if (SRC / "testing") in path.parents:
            continue
        kit = sorted(m for m in _imported_modules(path) if m == "rlcore.testing" or m.startswith("rlcore.testing."))
        if kit:
            offenders.append(f"{path.relative_to(SRC.parent)}: {', '.join(kit)}")
    assert not offenders, "production modules import the test kit:\n" + "\n".join(offenders)


#: (old module, name, where it lives now)
MOVED = [
    ("rlcore.cli.run_cmd", "train", "rlcore.run.train"),
    ("rlcore.algorithms.loss_functions", "ClippedPGLossConfig", "rlcore.algorithms.grpo.loss_config"),
    ("rlcore.algorithms.loss_functions", "NLLLoss", "rlcore.algorithms.sft.loss"),
    ("rlcore.testing.resume_check", "run_resume", "rlcore.testing.conformance.resume_check"),
    ("rlcore.testing.reference_worker", "ReferenceWorker", "rlcore.backends.reference.worker"),
    ("rlcore.distributed.process_group", "init_distributed", "rlcore.training.process_group"),
    ("rlcore.cli.run_control", "StopOnSignals", "rlcore.run.stopping"),
    ("rlcore.cli.run_control", "StopRequested", "rlcore.run.stopping"),
    ("rlcore.cli.run_control", "one_line", "rlcore.cli.errors"),
    ("rlcore.testing.models", "build_tiny_tokenizer", "rlcore.models.tokenizer"),
    ("rlcore.testing.models", "BYTE_OFFSET", "rlcore.models.tokenizer"),
    ("rlcore.testing.models", "build_tiny_model", "rlcore.models.build"),
    ("rlcore.testing.models", "ARCHS", "rlcore.models.build"),
    ("rlcore.testing.models", "tiny_model_path", "rlcore.models.cache"),
    ("rlcore.models", "BUILTIN_MODELS", "rlcore.models.builtin"),
    ("rlcore.models", "resolve_builtin_models", "rlcore.models.builtin"),
    ("rlcore.testing.conformance", "TrainingBackendConformance", "rlcore.testing.conformance.training"),
    ("rlcore.testing.conformance", "_TrainingKit", "rlcore.testing.conformance.training_kit"),
    ("rlcore.testing.conformance", "GenerationBackendConformance", "rlcore.testing.conformance.generation"),
    ("rlcore.testing.conformance", "logprob_problems", "rlcore.testing.conformance.checkers"),
    ("rlcore.testing.conformance", "plugin_reference", "rlcore.testing.conformance.probes"),
    ("rlcore.testing.conformance", "weight_problems", "rlcore.testing.oracle"),
]


@pytest.mark.parametrize(("old", "name", "new"), MOVED, ids=[f"{o}.{n}" for o, n, _ in MOVED])
def test_moved_names_keep_their_old_import_path(old, name, new):
    assert getattr(importlib.import_module(old), name) is getattr(importlib.import_module(new), name)


def test_the_old_toy_task_paths_still_import():
    """rlcore 0.1's configs name the toy's functions (their sections load as data and env: test_environments)."""
    from rlcore.environments.digits import digit_prompts, digit_reward
    from rlcore.plugins import import_object

    assert import_object("rlcore.run.tasks.toy:digit_reward") is digit_reward
    assert import_object("rlcore.run.tasks.toy:digit_prompts") is digit_prompts


def test_the_conformance_kit_exports_what_it_did_before_the_split():
    import rlcore.testing.conformance as kit

    assert sorted(kit.__all__) == sorted(
        [
            "CAPABILITY_METHODS",
            "GENERATION_WORKER_METHODS",
            "HEAVY_MODULES",
            "TRAINING_WORKER_METHODS",
            "EngineLifecycleConformance",
            "GenerationBackendConformance",
            "LifecycleSubject",
            "SquaredErrorValueLoss",
            "StepRecord",
            "TrainingBackendConformance",
            "ValueModelConformance",
            "distillation_step",
            "dpo_step",
            "generation_output_problems",
            "hf_token_logprobs",
            "hf_values",
            "lifecycle_problems",
            "load_hf_model",
            "logprob_problems",
            "oracle_gradients",
            "plugin_reference",
            "single_process_sgd",
            "train_and_save_step",
            "value_sgd_step",
            "weight_problems",
        ]
    )
    assert all(hasattr(kit, name) for name in kit.__all__)


def test_moved_modules_stay_light():
    code = (
        "import sys, rlcore.models, rlcore.run.train, rlcore.algorithms.grpo.loop, rlcore.run.build, "
        "rlcore.config.resolve, rlcore.cli.run_control, rlcore.testing.models, rlcore.backends.reference.plugin; "
        "print(sorted(m for m in ('torch', 'ray', 'transformers', 'numpy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
