"""The conformance kit against the built-in 'reference' backend, and the kit's own ability to fail.

``TestReferenceBackend`` is the kit exactly as a plugin author runs it. The
other tests show that the kit's checks are not vacuous: its checkers reject
doctored outputs, and whole kit tests fail against deliberately broken
backends (a heavy plugin module, an incomplete worker, a worker that averages
gradients over ranks instead of summing them).
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from rlcore.backends.reference.worker import ReferenceWorker
from rlcore.plugins import BackendSpec, hookimpl
from rlcore.testing.conformance import (
    TrainingBackendConformance,
    _TrainingKit,
    generation_output_problems,
    logprob_problems,
    weight_problems,
)


class TestReferenceBackend(TrainingBackendConformance):
    """The reference backend, installed through rlcore's own entry point."""

    backend_name = "reference"


# --------------------------------------------------------------------------- the checkers reject bad outputs


def _good_logprobs() -> tuple[torch.Tensor, torch.Tensor]:
    lengths = torch.tensor([4, 2])
    lp = torch.tensor([[0.0, -1.0, -2.0, -3.0], [0.0, -0.5, 0.0, 0.0]])
    return lp, lengths


def test_logprob_checker_accepts_conforming_logprobs():
    lp, lengths = _good_logprobs()
    assert logprob_problems(lp, lengths, lp.clone()) == []


@pytest.mark.parametrize(
    "defect, message",
    [
        (lambda lp: lp.double(), "dtype"),
        (lambda lp: lp.index_put((torch.tensor([0]), torch.tensor([0])), torch.tensor(-1.0)), "position 0"),
        (lambda lp: lp.index_put((torch.tensor([1]), torch.tensor([3])), torch.tensor(-1.0)), "padding"),
        (lambda lp: lp + torch.tensor([[0.0, 1e-4, 0.0, 0.0], [0.0] * 4]), "differ"),
        (lambda lp: lp[:, :3], "shape"),
    ],
)
def test_logprob_checker_rejects(defect, message):
    lp, lengths = _good_logprobs()
    problems = logprob_problems(defect(lp.clone()), lengths, lp)
    assert any(message in p for p in problems), problems


def test_weight_checker_measures_errors_against_the_update():
    initial = {"w": torch.zeros(3), "b": torch.ones(2)}
    expected = {"w": torch.tensor([0.1, -0.2, 0.0]), "b": torch.ones(2)}
    assert weight_problems({k: v.clone() for k, v in expected.items()}, expected, initial, 1e-4) == []
    half_step = {"w": expected["w"] / 2, "b": torch.ones(2)}
    assert any("w differs" in p for p in weight_problems(half_step, expected, initial, 1e-4))
    assert any("missing" in p for p in weight_problems({"w": expected["w"]}, expected, initial, 1e-4))
    assert any("vacuous" in p for p in weight_problems(initial, initial, initial, 1e-4))


def _generation_case():
    prompts = torch.tensor([[5, 6, 7], [8, 9, 0]])
    lengths = torch.tensor([3, 2])
    out = {
        "output_ids": torch.tensor([[5, 6, 7, 10, 11], [8, 9, 12, 0, 0]]),
        "generation_lengths": torch.tensor([2, 1]),
        "unpadded_sequence_lengths": torch.tensor([5, 3]),
        "logprobs": torch.tensor([[0.0, 0.0, 0.0, -0.1, -0.2], [0.0, 0.0, -0.3, 0.0, 0.0]]),
    }
    return prompts, lengths, out


def test_generation_checker_accepts_conforming_output():
    prompts, lengths, out = _generation_case()
    assert generation_output_problems(prompts, lengths, out, max_new_tokens=2, pad_id=0) == []


@pytest.mark.parametrize(
    "key, row, col, value, message",
    [
        ("output_ids", 1, 4, 13, "right-padded"),
        ("output_ids", 0, 1, 99, "prompt"),
        ("logprobs", 0, 1, -0.5, "prompt and padding"),
        ("logprobs", 0, 3, 0.5, "<= 0"),
        ("unpadded_sequence_lengths", 1, None, 4, "input_lengths + generation_lengths"),
    ],
)
def test_generation_checker_rejects(key, row, col, value, message):
    prompts, lengths, out = _generation_case()
    out[key][(row, col) if col is not None else row] = value
    problems = generation_output_problems(prompts, lengths, out, max_new_tokens=2, pad_id=0)
    assert any(message in p for p in problems), problems


# --------------------------------------------------------------------------- whole kit tests fail on broken backends

_BROKEN_PLUGIN = textwrap.dedent("""
    import torch  # the defect: a plugin module must not import torch
    from rlcore.plugins import BackendSpec, hookimpl

    class IncompleteWorker:
        def get_logprobs(self, data):
            pass

    @hookimpl
    def rlcore_register_backends(register):
        register(BackendSpec(name="heavy", kind="training", worker_class="kit_broken_plugin:IncompleteWorker"))
""")


@pytest.fixture
def broken_plugin(tmp_path, monkeypatch, rlcore_registry):
    (tmp_path / "kit_broken_plugin.py").write_text(_BROKEN_PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    import kit_broken_plugin

    rlcore_registry.register_plugin(kit_broken_plugin, name="heavy")
    yield kit_broken_plugin


def test_kit_rejects_a_heavy_plugin_module(broken_plugin, rlcore_registry):
    class Kit(TrainingBackendConformance):
        backend_name = "heavy"
        plugin = broken_plugin

    with pytest.raises(AssertionError, match=r"imported \['torch'\]"):
        Kit().test_plugin_module_is_light(rlcore_registry)


def test_kit_rejects_an_incomplete_worker(broken_plugin, rlcore_registry):
    class Kit(TrainingBackendConformance):
        backend_name = "heavy"

    with pytest.raises(AssertionError, match=r"breaks the worker contract:\n(.*\n)*IncompleteWorker.train: missing"):
        Kit().test_spec_is_valid(rlcore_registry.resolve("heavy"))


class MeanGradWorker(ReferenceWorker):
    """A classic data-parallel bug: gradients averaged over ranks instead of summed (contract 3)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        step, world = self.optimizer.step, torch.distributed.get_world_size()

        def averaged_step(*a, **k):
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad /= world
            return step(*a, **k)

        self.optimizer.step = averaged_step


class _MeanGradPlugin:
    @hookimpl
    def rlcore_register_backends(self, register):
        register(BackendSpec(name="meangrad", kind="training", worker_class=f"{__name__}:MeanGradWorker"))


def test_kit_catches_gradients_averaged_over_ranks(
    ray_session, tiny_model_dir, tiny_tokenizer, tmp_path, rlcore_registry
):
    rlcore_registry.register_plugin(_MeanGradPlugin(), name="meangrad")

    class Kit(TrainingBackendConformance):
        backend_name = "meangrad"

    kit = _TrainingKit(Kit, rlcore_registry.resolve("meangrad"), tiny_model_dir, tiny_tokenizer, tmp_path)
    try:
        Kit().test_train_steps_match_single_process(kit, "single")  # one rank: averaging changes nothing
        with pytest.raises(AssertionError) as failure:
            Kit().test_train_steps_match_single_process(kit, "world")
    finally:
        kit.shutdown()
    message = str(failure.value)
    assert "'world' vs single-process oracle" in message and "differs by" in message, message


class LengthSortingWorker(ReferenceWorker):
    """A plausible padding optimisation that breaks DPO: each rank sorts its rows by length before training, so
    rows 2i / 2i+1 of its micro-batches are no longer a chosen/rejected pair (NLL and PG are per-row sums: they
    cannot tell)."""

    def train(self, data, *args, **kwargs):
        order = sorted(range(data.size), key=lambda i: int(data["input_lengths"][i]))
        sorted_rows = type(data)({key: value[order] for key, value in data.items()})
        return super().train(sorted_rows, *args, **kwargs)


class _LengthSortingPlugin:
    @hookimpl
    def rlcore_register_backends(self, register):
        register(BackendSpec(name="lengthsort", kind="training", worker_class=f"{__name__}:LengthSortingWorker"))


def test_kit_catches_a_backend_that_splits_dpo_pairs(
    ray_session, tiny_model_dir, tiny_tokenizer, tmp_path, rlcore_registry
):
    rlcore_registry.register_plugin(_LengthSortingPlugin(), name="lengthsort")

    class Kit(TrainingBackendConformance):
        backend_name = "lengthsort"

    kit = _TrainingKit(Kit, rlcore_registry.resolve("lengthsort"), tiny_model_dir, tiny_tokenizer, tmp_path)
    try:
        with pytest.raises(AssertionError) as failure:
            Kit().test_train_steps_match_single_process(kit, "world")
    finally:
        kit.shutdown()
    message = str(failure.value)
    # steps 1 (NLL) and 2 (PG) agree with the oracle; the DPO step does not
    assert "step 3: loss" in message and "step 1" not in message and "step 2" not in message, message


# --------------------------------------------------------------------------- the pytest plugin's fixtures


def test_make_cluster_reserves_and_releases_bundles(make_cluster):
    import ray

    cluster = make_cluster(2)
    assert cluster.world_size == 2 and len(cluster.bundles()) == 2
    pg = cluster.get_placement_group()
    assert ray.util.placement_group_table(pg)["state"] == "CREATED"
    make_cluster.shutdown()  # what the fixture does after the test
    assert ray.util.placement_group_table(pg)["state"] == "REMOVED"


def test_rlcore_registry_is_isolated_and_restored(rlcore_registry):
    from rlcore.plugins import get_registry

    assert get_registry() is rlcore_registry and rlcore_registry.records == []
