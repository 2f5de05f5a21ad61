"""The kit's checkpoint test fails, naming the cause, on backends whose checkpoints do not resume training.

Two deliberately broken third-party backends built on the reference backend
reload their weights perfectly (so a reload-only check passes them): one
ignores the optimizer file, one restores the optimizer but not the LR
scheduler. Each is registered in an isolated registry and run through the
kit's ``test_checkpoint_round_trip``; the reference backend itself passes it
in ``test_conformance_reference.py``. The diagnosis is also unit-tested on
synthetic updates.
"""

from __future__ import annotations

import pytest
import torch

from rlcore.backends.reference.worker import ReferenceWorker
from rlcore.plugins import BackendSpec, hookimpl
from rlcore.testing.conformance import TrainingBackendConformance, _TrainingKit
from rlcore.testing.conformance.resume_check import RECIPE, diagnose_update
from rlcore.training.checkpoint import load_torch_state


class OptimizerDroppingWorker(ReferenceWorker):
    """Loads a checkpoint's weights, ignores its optimizer file: fresh Adam moments, a restarted schedule."""

    def _load_optimizer(self, optimizer_path: str) -> None:
        pass


class SchedulerDroppingWorker(ReferenceWorker):
    """Restores the optimizer (moments and the current lr) but not the LR scheduler's position."""

    def _load_optimizer(self, optimizer_path: str) -> None:
        self.optimizer.load_state_dict(load_torch_state(optimizer_path)["optimizer"])


class _Plugin:
    """Registers one worker class as a training backend (what a third-party plugin module does)."""

    def __init__(self, name: str, worker: type) -> None:
        self.name, self.worker = name, worker

    @hookimpl
    def rlcore_register_backends(self, register):
        register(
            BackendSpec(
                name=self.name,
                kind="training",
                capabilities={"train", "logprobs", "checkpoint"},
                worker_class=f"{__name__}:{self.worker.__name__}",
            )
        )


@pytest.mark.parametrize(
    "worker, cause, not_cause",
    [
        (OptimizerDroppingWorker, "optimizer state (Adam moments) was not restored", "schedule was not restored"),
        (SchedulerDroppingWorker, "learning-rate schedule was not restored", "Adam moments"),
    ],
)
def test_checkpoint_test_names_the_lost_state(
    ray_session, tiny_model_dir, tiny_tokenizer, tmp_path, rlcore_registry, worker, cause, not_cause
):
    name = worker.__name__.lower()
    rlcore_registry.register_plugin(_Plugin(name, worker), name=name)

    class Kit(TrainingBackendConformance):
        backend_name = name
        world_size = 1  # the defect does not depend on dp; one rank starts faster

    kit = _TrainingKit(Kit, rlcore_registry.resolve(name), tiny_model_dir, tiny_tokenizer, tmp_path)
    try:
        with pytest.raises(AssertionError) as failure:
            Kit().test_checkpoint_round_trip(kit)
    finally:
        kit.shutdown()
    message = str(failure.value)
    assert "after resume the update differs from uninterrupted training: " + cause in message, message
    assert not_cause not in message, message
    # The weights were restored: a reload-only check would have passed.
    assert "logprobs of the policy restored" not in message and "the model the checkpoint restored" not in message


# --------------------------------------------------------------------------- the diagnosis on synthetic updates


def _case(actual_update: torch.Tensor) -> str:
    before = {"w": torch.zeros(4)}
    expected = {"w": torch.tensor([0.3, -0.1, 0.2, 0.05])}
    fresh = {"w": torch.tensor([1.0, -1.0, -1.0, 1.0])}  # lr-1 update of a new optimizer
    return diagnose_update(2, before, {"w": actual_update}, expected, fresh, RECIPE)


def test_diagnosis_reads_a_rescaled_update_as_a_lost_schedule():
    message = _case(torch.tensor([0.3, -0.1, 0.2, 0.05]) * 1.5)
    assert "learning-rate schedule was not restored" in message and "1.5x" in message, message


def test_diagnosis_reads_a_fresh_optimizer_direction_as_lost_moments():
    message = _case(torch.tensor([1.0, -1.0, -1.0, 1.0]) * RECIPE.lr_at(1))
    assert "optimizer state (Adam moments) was not restored" in message, message
    assert "schedule restarted too" in message, message


def test_diagnosis_does_not_blame_the_schedule_for_round_off():
    message = _case(torch.tensor([0.3, -0.1, 0.2, 0.05]) * (1 + 1e-6))
    assert "nondeterministic" in message and "schedule" not in message, message


def test_diagnosis_does_not_guess_when_neither_explains_the_update():
    message = _case(torch.tensor([-0.2, 0.4, 0.1, 0.0]))
    assert "neither lost Adam moments nor a wrong learning rate" in message, message
