"""The engine lifecycle checks (:mod:`rlcore.testing.conformance.lifecycle`) as a pytest class mixin."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import pytest

from rlcore.plugins import Capability
from rlcore.testing.conformance.lifecycle import (
    LifecycleSubject,
    SentPerRank,
    check_identity_refit,
    check_pause_abort,
    check_pause_keep,
    check_pause_wait,
    check_refit_while_paused,
    check_restart_is_stale_until_refit,
    check_sleep_wake_twice,
    check_submit_during_drain,
    check_submit_while_paused,
    greedy_reference,
    output_problems,
)

if TYPE_CHECKING:
    import torch


class EngineLifecycleConformance:
    """The lifecycle checks as tests; mix into a :class:`GenerationBackendConformance` subclass (it gives the
    ``generation`` and ``backend_spec`` fixtures), with ``generation_overrides`` that make the engine serve
    continuously and ``max_new_tokens`` large enough that requests are still running after ``settle_s``.

    Skips when the backend does not declare 'async_engine' or the instance does not serve continuously. The
    refit checks need :meth:`refit` (the kit's default skips); the restart check starts the backend again with
    :meth:`restart_engine` (default: ``make_generation`` on the same cluster).
    """

    lifecycle_timeout_s: ClassVar[float] = 60.0
    lifecycle_settle_s: ClassVar[float] = 0.3
    lifecycle_paused_probe_s: ClassVar[float] = 0.5
    #: The backend's own errors for an engine that no refit fed (the core's EnginesNotRefitError always counts).
    stale_errors: ClassVar[tuple[type[BaseException], ...]] = ()

    def refit(self, engine: Any, state_dict: dict[str, torch.Tensor], version: int) -> SentPerRank | None:
        """Push ``state_dict`` (HF names) into ``engine``; the kit names the version afterwards. Return None when
        every engine rank got the whole tensors; otherwise, per rank (in the order of ``weight_fingerprints``'
        reports), the fingerprints of what it was sent (a tensor-parallel rank's slices: e.g. each rank's
        ``stream_to_receiver(...).fingerprints``), which the identity-refit check compares that rank's with."""
        raise NotImplementedError

    def restart_engine(self, generation: dict) -> Any:
        """Start the backend again on ``generation["cluster"]`` (the old engine is shut down already)."""
        return self.make_generation(generation["cluster"], generation["config"])  # type: ignore[attr-defined]

    @pytest.fixture(scope="class")
    @classmethod
    def lifecycle(cls, generation: dict, backend_spec: Any) -> LifecycleSubject:
        from rlcore.data import BatchedDataDict
        from rlcore.testing.models import make_batch
        from rlcore.testing.oracle import load_hf_model

        if Capability.ASYNC_ENGINE not in backend_spec.capabilities:
            pytest.skip(f"backend '{backend_spec.name}' does not declare 'async_engine'")
        engine = generation["engine"]
        if not engine.continuous_serving:
            pytest.skip(f"{cls.__name__}'s engine does not serve continuously: configure it so in generation_overrides")
        kit = cls()
        has_refit = cls.refit is not EngineLifecycleConformance.refit
        raw = make_batch(generation["tokenizer"], 4 * getattr(cls, "world_size", 1), 3, 8, seed=11)

        def restart() -> Any:
            generation["engine"] = kit.restart_engine(generation)  # the fixture's teardown shuts this one down
            return generation["engine"]

        subject = LifecycleSubject(
            engine=engine,
            prompts=BatchedDataDict(input_ids=raw["input_ids"], input_lengths=raw["input_lengths"]),
            weights=dict(load_hf_model(generation["model_dir"]).state_dict()) if has_refit else None,
            refit=kit.refit if has_refit else None,
            restart=restart,
            verified_refit=Capability.VERIFIED_REFIT in backend_spec.capabilities,
            in_flight_weight_updates=Capability.IN_FLIGHT_WEIGHT_UPDATES in backend_spec.capabilities,
            stale_errors=cls.stale_errors,
            timeout_s=cls.lifecycle_timeout_s,
            settle_s=cls.lifecycle_settle_s,
            paused_probe_s=cls.lifecycle_paused_probe_s,
            logprob_atol=getattr(cls, "logprob_atol", 1e-4),
        )
        expected = greedy_reference(subject)
        blocking = engine.generate(subject.prompts, greedy=True)
        problems = output_problems(subject, blocking, "generate (blocking)")
        assert not problems, "the served output differs from generate's: " + "\n".join(problems)
        assert int(expected["generation_lengths"].min()) > 1, "completions of one token: the checks would be vacuous"
        return subject

    def _run(self, check: Callable[[LifecycleSubject], list[str]], subject: LifecycleSubject) -> None:
        problems = check(subject)
        assert not problems, "\n".join(problems)

    def _needs_refit(self, subject: LifecycleSubject) -> None:
        if subject.refit is None:
            pytest.skip(f"{type(self).__name__} does not implement refit(engine, state_dict, version)")

    def test_lifecycle_pause_wait(self, lifecycle: LifecycleSubject) -> None:
        self._run(check_pause_wait, lifecycle)

    def test_lifecycle_pause_keep(self, lifecycle: LifecycleSubject) -> None:
        self._run(check_pause_keep, lifecycle)

    def test_lifecycle_pause_abort(self, lifecycle: LifecycleSubject) -> None:
        self._run(check_pause_abort, lifecycle)

    def test_lifecycle_submit_while_paused(self, lifecycle: LifecycleSubject) -> None:
        self._run(check_submit_while_paused, lifecycle)

    def test_lifecycle_submit_during_drain(self, lifecycle: LifecycleSubject) -> None:
        self._run(check_submit_during_drain, lifecycle)

    def test_lifecycle_sleep_and_wake_twice(self, lifecycle: LifecycleSubject) -> None:
        self._run(check_sleep_wake_twice, lifecycle)

    def test_lifecycle_refit_while_paused(self, lifecycle: LifecycleSubject) -> None:
        self._needs_refit(lifecycle)
        self._run(check_refit_while_paused, lifecycle)

    def test_lifecycle_identity_refit(self, lifecycle: LifecycleSubject) -> None:
        self._needs_refit(lifecycle)
        self._run(check_identity_refit, lifecycle)

    def test_lifecycle_restarted_engine_is_stale_until_refit(self, lifecycle: LifecycleSubject) -> None:
        self._needs_refit(lifecycle)
        self._run(check_restart_is_stale_until_refit, lifecycle)
