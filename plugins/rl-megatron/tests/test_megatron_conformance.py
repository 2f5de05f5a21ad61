"""The rlcore conformance kit against the megatron backend (installed through its entry point).

Two ranks, data parallel (TP=PP=1, the kit's tiny Llama has one KV head):
logprob alignment and HF parity, loss/gradient invariance to dp size and
micro-batch size against a single-process SGD oracle (so data-parallel
gradients are really summed), reference model swap, checkpoint round trip,
refit info, top-k. TP/PP parity is in test_megatron_parallel.py.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from megatron_helpers import PLAIN_SGD, _merge

from rlcore.testing.conformance import TrainingBackendConformance, ValueModelConformance
from rlcore.testing.conformance.resume_check import AdamRecipe
from rlcore.testing.conformance.value_model import VALUE_MOMENTUM

pytest_plugins = ["rlcore.testing.pytest_plugin"]
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class TestMegatronBackend(TrainingBackendConformance, ValueModelConformance):
    backend_name = "megatron"
    reads_policy_optimizer = False  # megatron_cfg.optimizer is its optimizer: plain SGD below

    def policy_overrides(self) -> dict:
        # The kit's oracle is plain SGD; the megatron backend takes its optimizer from megatron_cfg.
        return {"megatron_cfg": PLAIN_SGD}

    def value_policy_overrides(self) -> dict:
        # The value kit's SGD with momentum (optimizer state a resume must restore), in megatron_cfg's terms.
        return {"megatron_cfg": _merge(PLAIN_SGD, {"optimizer": {"sgd_momentum": VALUE_MOMENTUM}})}

    def resume_policy_overrides(self, recipe: AdamRecipe) -> dict:
        # The resume check's Adam and linear warm-up, in megatron_cfg's terms (weight decay stays 0).
        beta1, beta2 = recipe.betas
        return {
            "megatron_cfg": {
                "optimizer": {
                    "optimizer": "adam",
                    "lr": recipe.lr,
                    "adam_beta1": beta1,
                    "adam_beta2": beta2,
                    "adam_eps": recipe.eps,
                },
                "scheduler": {
                    "lr_decay_style": "constant",
                    "lr_warmup_iters": recipe.warmup_steps,
                    "lr_warmup_init": recipe.lr * recipe.warmup_start_factor,
                },
            }
        }


def test_plugin_declares_without_importing_engines() -> None:
    """Beyond the kit's check: registering the plugin imports no transformers or megatron submodule either."""
    probe = (
        "import json, sys\n"
        "from rlcore.plugins import Registry\n"
        "import rl_megatron.plugin as plugin\n"
        "registry = Registry()\n"
        "registry.register_plugin(plugin, name='probe')\n"
        "print(json.dumps({'records': [r.as_dict() for r in registry.records],\n"
        "                  'modules': sorted(sys.modules)}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    heavy = [
        m
        for m in out["modules"]
        if m.split(".")[0] in ("torch", "ray", "vllm", "transformers") or m.startswith("megatron.")
    ]
    assert not heavy, f"the plugin module imported {heavy[:10]}"
    (record,) = out["records"]
    assert (record["name"], record["kind"], record["status"]) == ("megatron", "training", "ok")
    assert "megatron" not in out["modules"], "checking the requirement 'megatron.core' imported its parent package"
