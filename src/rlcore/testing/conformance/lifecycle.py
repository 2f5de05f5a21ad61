"""Kit checks for the engine lifecycle (the 'async_engine' and 'in_flight_weight_updates' capabilities).

The contract is :meth:`rlcore.interfaces.GenerationInterface.pause_generation` and its neighbours. Each check is
a pure function of a :class:`LifecycleSubject` (an engine, greedy prompts, the engine's own weights and hooks to
push and restart) returning problem lines, empty when the promise holds, so that in-process fakes are checked
without pytest classes (``lifecycle_fakes``); the mixin ``EngineLifecycleConformance``
(:mod:`~rlcore.testing.conformance.lifecycle_conformance`) runs them on a real backend.

Every wait is bounded: each call into the engine runs in a helper thread joined with ``timeout_s``, and
results are taken with ``as_completed(..., timeout_s=)``, so an engine that hangs (a request submitted during a
drain that never starts, vLLM #45326) is a problem line naming the check and the call within seconds, never a
hung test. An engine left hung by a failed check is not waited for again.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import torch

    from rlcore.data import BatchedDataDict

T = TypeVar("T")

#: ``refit(engine, state_dict, version)``: push ``state_dict`` into ``engine`` (the caller names the version).
#: It may return what the transport sent each engine rank (:data:`SentPerRank`); None: every rank got the whole
#: ``state_dict``.
RefitHook = Callable[[Any, "dict[str, torch.Tensor]", int], "SentPerRank | None"]
#: Per engine rank, in the order of ``weight_fingerprints``' reports: ``{name: fingerprint}`` of what the refit
#: sent it (e.g. the ``fingerprints`` of each rank's :func:`rlcore.refit.shared_memory.stream_to_receiver`). A
#: tensor-parallel rank is sent only the slices it reads, so its fingerprints are of those slices.
SentPerRank = Sequence[Mapping[str, int]]


class Hung(Exception):
    """An engine call did not return within the check's bound."""


@dataclass
class LifecycleSubject:
    """What the checks drive: ``engine`` (a continuously serving ``GenerationInterface``) and its promises.

    ``weights``: the weights the engine holds (its checkpoint), for identity refits. ``refit``: pushes weights
    into an engine. ``restart``: starts the backend again on the same resources (the old one is shut down
    first) and returns the new engine. ``stale_errors``: the backend's own errors for an engine serving
    weights no refit gave it (the core's :class:`~rlcore.run.engine_recovery.EnginesNotRefitError` always
    counts). ``settle_s``: the wait after a submission before a pause, so that the requests are running;
    ``paused_probe_s``: how long a paused request is watched for finishing.
    """

    engine: Any
    prompts: BatchedDataDict
    weights: dict[str, torch.Tensor] | None = None
    refit: RefitHook | None = None
    restart: Callable[[], Any] | None = None
    verified_refit: bool = False
    in_flight_weight_updates: bool = False
    stale_errors: tuple[type[BaseException], ...] = ()
    timeout_s: float = 60.0
    settle_s: float = 0.3
    paused_probe_s: float = 0.5
    logprob_atol: float = 1e-4
    expected: BatchedDataDict | None = field(default=None, repr=False)
    paused: bool = False


def bounded(what: str, call: Callable[[], T], timeout_s: float) -> T:
    """``call()``, run in a helper thread; :class:`Hung` naming ``what`` when it has not returned in ``timeout_s``."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True, name=f"lifecycle-kit: {what}")
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise Hung(f"{what} did not return within {timeout_s:g} s (hung)")
    if "error" in box:
        raise box["error"]
    return box["value"]


def lifecycle_check(name: str) -> Callable[[Callable[[LifecycleSubject], list[str]]], Callable[..., list[str]]]:
    """A check's problems prefixed with its ``name``; a hang or an error becomes one problem line; an engine left
    paused by a failed check is resumed (bounded) so that the next check starts clean."""

    def wrap(check: Callable[[LifecycleSubject], list[str]]) -> Callable[..., list[str]]:
        @functools.wraps(check)
        def run(subject: LifecycleSubject) -> list[str]:
            try:
                problems = check(subject)
            except Hung as exc:
                problems = [str(exc)]
            except Exception as exc:  # noqa: BLE001 - reported as the check's problem
                problems = [f"raised {type(exc).__name__}: {exc}"]
            if subject.paused:
                try:
                    bounded("resume_generation", subject.engine.resume_generation, subject.timeout_s)
                    subject.paused = False
                except Exception as exc:  # noqa: BLE001
                    problems.append(f"resume_generation after the check: {type(exc).__name__}: {exc}")
            return [f"{name}: {p}" for p in problems]

        return run

    return wrap


# -- engine calls, each bounded ------------------------------------------------------------------------------
def submit(s: LifecycleSubject, what: str = "generate_async") -> Any:
    return bounded(what, lambda: s.engine.generate_async(s.prompts, greedy=True), s.timeout_s)


def collect_within(s: LifecycleSubject, handle: Any, what: str, timeout_s: float | None = None) -> BatchedDataDict:
    """The output of ``handle`` through ``as_completed`` with a timeout; :class:`Hung` when not done in time."""
    limit = s.timeout_s if timeout_s is None else timeout_s

    def take() -> BatchedDataDict:
        return next(iter(s.engine.as_completed([handle], timeout_s=limit)))[1]

    try:
        return bounded(what, take, limit + 5.0)
    except TimeoutError as exc:
        raise Hung(f"{what} was not done within {limit:g} s (hung)") from exc


def finished_within(s: LifecycleSubject, handle: Any, seconds: float) -> bool:
    try:
        collect_within(s, handle, "probe", seconds)
    except Hung:
        return False
    return True


def pause(s: LifecycleSubject, mode: str) -> None:
    bounded(
        f"pause_generation(mode={mode!r})",
        lambda: s.engine.pause_generation(mode=mode, timeout_s=s.timeout_s),
        s.timeout_s + 5.0,
    )
    s.paused = True


def resume(s: LifecycleSubject, recompute_kv_cache: bool = False) -> None:
    bounded(
        f"resume_generation(recompute_kv_cache={recompute_kv_cache})",
        lambda: s.engine.resume_generation(recompute_kv_cache=recompute_kv_cache),
        s.timeout_s,
    )
    s.paused = False


def greedy_reference(s: LifecycleSubject) -> BatchedDataDict:
    """The unpaused greedy output of ``s.prompts`` that every check compares with (computed once)."""
    if s.expected is None:
        s.expected = collect_within(s, submit(s), "an unpaused request")
    return s.expected


def output_problems(s: LifecycleSubject, out: BatchedDataDict, what: str) -> list[str]:
    """``out`` against the unpaused greedy output: the same tokens, lengths and (within tolerance) logprobs."""
    import torch

    expected = greedy_reference(s)
    if tuple(out["output_ids"].shape) != tuple(expected["output_ids"].shape) or not torch.equal(
        out["generation_lengths"], expected["generation_lengths"]
    ):
        return [
            f"{what}: generation lengths {out['generation_lengths'].tolist()} differ from the unpaused "
            f"{expected['generation_lengths'].tolist()} (a partial or extra completion)"
        ]
    if not torch.equal(out["output_ids"], expected["output_ids"]):
        rows = (out["output_ids"] != expected["output_ids"]).any(-1).nonzero().flatten().tolist()
        return [f"{what}: greedy tokens differ from the unpaused output in rows {rows}"]
    err = float((out["logprobs"] - expected["logprobs"]).abs().max())
    if err > s.logprob_atol:
        return [f"{what}: logprobs differ from the unpaused output by {err:.3g} (> {s.logprob_atol:g})"]
    return []


def _settle(s: LifecycleSubject) -> None:
    time.sleep(s.settle_s)


# -- (a) each pause mode with requests in flight -------------------------------------------------------------
@lifecycle_check("pause 'wait'")
def check_pause_wait(s: LifecycleSubject) -> list[str]:
    """``wait`` returns only once the requests in flight are done; after the resume they are unchanged."""
    greedy_reference(s)
    handle = submit(s)
    _settle(s)
    called = time.time()
    pause(s, "wait")
    problems = []
    if not finished_within(s, handle, s.paused_probe_s):
        problems.append("returned while requests were in flight: they were not done after the drain")
    resume(s)
    out = collect_within(s, handle, "the drained request")
    window = out.get("generation_window")
    if window is not None and float(window[:, 1].max()) < called:
        problems.append("the requests finished before the pause was called: vacuous, make them longer")
    return problems + output_problems(s, out, "the drained request")


@lifecycle_check("pause 'keep'")
def check_pause_keep(s: LifecycleSubject) -> list[str]:
    """``keep`` returns with the requests unfinished; they finish after the resume with the unpaused output."""
    return _held_across_pause(
        s,
        "keep",
        "the kept request",
        "a request in flight was done while paused (it ran on, or finished before the pause: make it longer)",
    )


@lifecycle_check("pause 'abort'")
def check_pause_abort(s: LifecycleSubject) -> list[str]:
    """``abort`` drops the partial outputs; on resume the requests start again and their callers get whole
    completions, equal to the unpaused ones (never an aborted one)."""
    return _held_across_pause(
        s,
        "abort",
        "the aborted request",
        "an aborted request's output was handed to its caller while paused (it must start again on resume; "
        "or it finished before the pause: make it longer)",
    )


def _held_across_pause(s: LifecycleSubject, mode: str, what: str, done_while_paused: str) -> list[str]:
    """A request in flight when ``mode`` pauses: not done while paused (``done_while_paused`` if it is), and
    after the resume the greedy output of an unpaused run."""
    greedy_reference(s)
    handle = submit(s)
    _settle(s)
    pause(s, mode)
    problems = [done_while_paused] if finished_within(s, handle, s.paused_probe_s) else []
    resume(s)
    return problems + output_problems(s, collect_within(s, handle, what), what)


# -- (b) requests submitted while paused or during a drain ---------------------------------------------------
def _submitted_or_refused(s: LifecycleSubject, what: str) -> tuple[Any, str | None]:
    """A handle, or None and the refusal (an exception raised within the bound: allowed, never a hang)."""
    try:
        return submit(s, what), None
    except Hung:
        raise
    except Exception as exc:  # noqa: BLE001 - a prompt refusal is one of the two allowed answers
        return None, f"{type(exc).__name__}: {exc}"


@lifecycle_check("request submitted while paused")
def check_submit_while_paused(s: LifecycleSubject) -> list[str]:
    """Queued (runs only after the resume, then completes) or refused at once; never hung."""
    greedy_reference(s)
    pause(s, "wait")
    handle, _refused = _submitted_or_refused(s, "generate_async while paused")
    problems = []
    if handle is not None and finished_within(s, handle, s.paused_probe_s):
        problems.append("it ran while the engine was paused")
    resume(s)
    if handle is not None:
        problems += output_problems(
            s, collect_within(s, handle, "a request submitted while paused, after the resume"), "it"
        )
    return problems


@lifecycle_check("request submitted during a 'wait' drain")
def check_submit_during_drain(s: LifecycleSubject) -> list[str]:
    """A request submitted while ``pause_generation("wait")`` drains the running ones completes after the resume
    (or is refused at once); one that is never started is caught here (vLLM #45326)."""
    greedy_reference(s)
    running = submit(s)
    _settle(s)
    done: dict[str, BaseException | None] = {}

    def drain() -> None:
        try:
            s.engine.pause_generation(mode="wait", timeout_s=s.timeout_s)
            done["error"] = None
        except BaseException as exc:  # noqa: BLE001 - reported below
            done["error"] = exc

    thread = threading.Thread(target=drain, daemon=True, name="lifecycle-kit: drain")
    thread.start()
    s.paused = True
    time.sleep(s.settle_s / 2)
    if not thread.is_alive():
        return ["the drain ended before a request could be submitted during it: vacuous, make requests longer"]
    late, _refused = _submitted_or_refused(s, "generate_async during the drain")
    thread.join(s.timeout_s + 5.0)
    if thread.is_alive():
        raise Hung(f"pause_generation(mode='wait') did not return within {s.timeout_s + 5.0:g} s (hung)")
    if done["error"] is not None:
        raise done["error"]
    resume(s)
    problems = output_problems(s, collect_within(s, running, "the drained request"), "the drained request")
    if late is not None:
        what = "the request submitted during the drain, after the resume"
        problems += output_problems(s, collect_within(s, late, what), what)
    return problems


# -- (c) sleep and wake twice --------------------------------------------------------------------------------
@lifecycle_check("finish/prepare twice")
def check_sleep_wake_twice(s: LifecycleSubject) -> list[str]:
    """``finish_generation`` twice, ``prepare_for_generation`` twice, then the same greedy output."""
    greedy_reference(s)
    for call in ("finish_generation", "finish_generation", "prepare_for_generation", "prepare_for_generation"):
        bounded(call, getattr(s.engine, call), s.timeout_s)
    return output_problems(s, collect_within(s, submit(s), "a request after waking"), "after waking twice")


# -- (d) refit while paused ----------------------------------------------------------------------------------
def _needs_refit(s: LifecycleSubject) -> tuple[RefitHook, dict[str, torch.Tensor]]:
    if s.refit is None or s.weights is None:
        raise ValueError("this check needs LifecycleSubject.refit and .weights")
    return s.refit, s.weights


def _refit(s: LifecycleSubject, version: int, engine: Any = None) -> SentPerRank | None:
    """Refit the subject's weights as ``version``; what the hook says it sent each rank (None: the whole)."""
    refit, weights = _needs_refit(s)
    target = s.engine if engine is None else engine
    sent = bounded(f"refit (version {version})", lambda: refit(target, weights, version), s.timeout_s)
    bounded("set_weight_version", lambda: target.set_weight_version(version), s.timeout_s)
    return sent


def _version_problems(out: BatchedDataDict, version: int, what: str) -> list[str]:
    tags = out.get("weight_version")
    if tags is None or tags.tolist() != [version] * len(out["output_ids"]):
        return [f"{what}: weight_version {None if tags is None else tags.tolist()}, expected [{version}] * B"]
    return []


@lifecycle_check("refit while paused")
def check_refit_while_paused(s: LifecycleSubject, version: int = 11) -> list[str]:
    """Pause (idle), refit (the same weights), name the version, resume: the next request serves the unpaused
    output tagged with that version. With 'in_flight_weight_updates', also with requests kept across the pause
    (with and without ``recompute_kv_cache``): their tokens form spans of the two versions."""
    greedy_reference(s)
    pause(s, "wait")
    _refit(s, version)
    resume(s)
    out = collect_within(s, submit(s), "a request after the refit")
    problems = output_problems(s, out, "after the refit") + _version_problems(out, version, "after the refit")
    if not s.in_flight_weight_updates:
        return problems
    for step, recompute in enumerate((False, True), start=1):
        handle = submit(s)
        _settle(s)
        pause(s, "keep")
        _refit(s, version + step)
        resume(s, recompute_kv_cache=recompute)
        what = f"a request kept across a refit (recompute_kv_cache={recompute})"
        out = collect_within(s, handle, what)
        problems += output_problems(s, out, what) + span_problems(out, version + step - 1, version + step, what)
    return problems


def span_problems(out: BatchedDataDict, old: int, new: int, what: str) -> list[str]:
    """``generation_weight_versions``: -1 off the generated tokens, ``old`` then ``new`` along each sample (at
    least one sample spans both: the refit landed while it ran), ``weight_version`` the oldest of each."""
    import torch

    versions = out.get("generation_weight_versions")
    if versions is None or tuple(versions.shape) != tuple(out["output_ids"].shape):
        return [f"{what}: generation_weight_versions missing or not shaped like output_ids"]
    ends = out["unpadded_sequence_lengths"]
    starts = ends - out["generation_lengths"]
    positions = torch.arange(versions.shape[1])[None, :]
    generated = (positions >= starts[:, None]) & (positions < ends[:, None])
    problems = []
    if (versions[~generated] != -1).any():
        problems.append(f"{what}: generation_weight_versions is not -1 at prompt/padding positions")
    spanned = False
    for row in range(len(versions)):
        tags = versions[row][generated[row]].tolist()
        if any(t not in (old, new) for t in tags) or tags != sorted(tags):
            problems.append(f"{what}: sample {row} has versions {sorted(set(tags))} out of order or not {old}/{new}")
        spanned |= old in tags and new in tags
        if tags and int(out["weight_version"][row]) != min(tags):
            problems.append(f"{what}: sample {row} weight_version {int(out['weight_version'][row])} != {min(tags)}")
    if not spanned:
        problems.append(f"{what}: no sample spans versions {old} and {new}: the refit did not land mid-request")
    return problems


# -- (e) identity refit --------------------------------------------------------------------------------------
@lifecycle_check("identity refit")
def check_identity_refit(s: LifecycleSubject, version: int = 21) -> list[str]:
    """The engine's own weights, sent twice: greedy outputs unchanged after each (vLLM #48284), and with
    'verified_refit' each engine rank's reported fingerprints equal those of what it was sent (the whole tensors,
    or, where the refit hook says so, the slices a tensor-parallel rank is sent), and are the same after both
    refits wherever it was sent the same."""
    from rlcore.refit.fingerprint import fingerprint
    from rlcore.testing.conformance.verified_refit import report_problems, unchanged_fingerprint_problems

    greedy_reference(s)
    problems: list[str] = []
    reports, sent_each = [], []
    whole = fingerprint(_needs_refit(s)[1].items()) if s.verified_refit else {}
    for n in (0, 1):
        sent = _refit(s, version + n)
        what = f"after identity refit {n + 1}"
        problems += output_problems(s, collect_within(s, submit(s), what), what)
        if s.verified_refit:
            reports.append(bounded("weight_fingerprints", s.engine.weight_fingerprints, s.timeout_s))
            sent_each.append([dict(r) for r in sent] if sent is not None else [whole] * len(reports[-1]))
            problems += [f"{what}: {p}" for p in report_problems(sent_each[-1], reports[-1], version + n)]
    if s.verified_refit:
        problems += unchanged_fingerprint_problems(sent_each, reports)
    return problems


# -- (f) a restarted engine is stale until its first refit ---------------------------------------------------
class _HookSynchronizer:
    """The run's synchronizer for :class:`~rlcore.run.engine_recovery.EngineRecovery`: refits through the hook."""

    def __init__(self, subject: LifecycleSubject, current: Callable[[], Any], version: int) -> None:
        self.subject, self.current, self.version, self.stale = subject, current, version, False

    def sync_weights(self) -> dict[str, float]:
        _refit(self.subject, self.version, engine=self.current())
        return {"weight_version": float(self.version)}

    def shutdown(self) -> None:
        return None


@lifecycle_check("restarted engine")
def check_restart_is_stale_until_refit(s: LifecycleSubject, version: int = 31) -> list[str]:
    """The core's restart (:class:`~rlcore.run.engine_recovery.EngineRecovery`) shuts the engine down and starts
    the backend again (``s.restart``); through :class:`RestartingGeneration` the new engine serves nothing until
    its first refit (the core's ``EnginesNotRefitError``, or the backend's own stale error), then the unpaused
    greedy output. ``s.engine`` is the new engine afterwards."""
    from rlcore.run.engine_recovery import (
        EngineRecovery,
        EnginesNotRefitError,
        RestartingGeneration,
        RestartingSynchronizer,
    )

    greedy_reference(s)
    if s.restart is None:
        raise ValueError("this check needs LifecycleSubject.restart")
    restart = s.restart
    holder: dict[str, EngineRecovery] = {}
    sync = _HookSynchronizer(s, lambda: holder["recovery"].generation, version)
    recovery = EngineRecovery(lambda: (restart(), sync), None, None, 1, s.engine, sync, awake=True)
    holder["recovery"] = recovery
    bounded("the restart", lambda: recovery._restart(RuntimeError("lifecycle kit: engine restarted")), s.timeout_s)
    s.engine = recovery.generation
    wrapped = RestartingGeneration(recovery)
    stale: tuple[type[BaseException], ...] = (EnginesNotRefitError, *s.stale_errors)
    problems = []
    for call in ("generate", "generate_async"):
        method = getattr(wrapped, call)
        try:
            bounded(f"{call} before the refit", functools.partial(method, s.prompts, greedy=True), s.timeout_s)
            problems.append(f"{call} served before the first refit")
        except stale:
            pass
    bounded("the refit", RestartingSynchronizer(recovery).sync_weights, s.timeout_s)
    out = bounded("generate after the refit", lambda: wrapped.generate(s.prompts, greedy=True), s.timeout_s)
    return problems + output_problems(s, out, "after the refit")


#: Every check, in the order they run (the restart last: it replaces the engine).
LIFECYCLE_CHECKS = (
    check_pause_wait,
    check_pause_keep,
    check_pause_abort,
    check_submit_while_paused,
    check_submit_during_drain,
    check_sleep_wake_twice,
    check_refit_while_paused,
    check_identity_refit,
    check_restart_is_stale_until_refit,
)


def lifecycle_problems(subject: LifecycleSubject) -> list[str]:
    """Every check that ``subject`` has the hooks for, in order; their problem lines."""
    problems = []
    for check in LIFECYCLE_CHECKS:
        if check in (check_refit_while_paused, check_identity_refit) and subject.refit is None:
            continue
        if check is check_restart_is_stale_until_refit and (subject.restart is None or subject.refit is None):
            continue
        problems += check(subject)
    return problems
