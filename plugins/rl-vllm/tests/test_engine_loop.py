"""``EngineLoop``'s orchestration against a scripted stand-in for vLLM's ``LLMEngine`` (no model): a step that
raises reaches every waiting caller naming the engine, a stop fails what is left, and nothing hangs; and two
loops in lock step (a tensor-parallel engine's leader and follower, over a real loopback ``TCPStore``) make the
same engine calls in the same order however late each rank gets its calls. The real engine's behaviour is tested
in ``test_async_engine.py`` and ``test_async_engine_tp.py``."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import pytest

from rl_vllm.engine_loop import EngineLoop, EngineLoopError
from rl_vllm.lockstep import Lockstep

WAIT_S = 5.0
LAG_S = 1.0  # the pair's bounds: a follower's silence, a leader's missing outcome


class ScriptedEngine:
    """Each request yields one token per step, ``length`` of them; ``fail_at`` makes that step raise."""

    def __init__(
        self, length: int = 3, fail_at: int | None = None, step_s: float = 0.0, final_only: bool = False
    ) -> None:
        self.length, self.fail_at, self.step_s = length, fail_at, step_s
        self.final_only = final_only  # like RequestOutputKind.FINAL_ONLY: a request's tokens come when it ends
        self.stuck: threading.Event | None = None  # set: each step blocks until it is set (a hung collective)
        self.requests: dict[str, int] = {}
        self.steps = 0
        self.threads: set[str] = set()
        self.calls: list[tuple] = []  # every call, in order: what a tensor-parallel engine's ranks must agree on

    def add_request(self, request_id: str, prompt: dict, params: Any, lora_request: Any = None) -> None:
        self.threads.add(threading.current_thread().name)
        self.calls.append(("add", request_id, tuple(prompt["prompt_token_ids"]), prompt["cache_salt"]))
        self.requests[request_id] = 0

    def abort_request(self, ids: list[str]) -> None:
        self.calls.append(("abort", tuple(ids)))
        for i in ids:
            self.requests.pop(i, None)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        self.calls.append(("reset", reset_running_requests))
        return True

    def step(self) -> list[Any]:
        self.threads.add(threading.current_thread().name)
        self.calls.append(("step",))
        time.sleep(self.step_s)
        if self.stuck is not None:
            self.stuck.wait()
        self.steps += 1
        if self.steps == self.fail_at:
            raise RuntimeError("kernel exploded")
        outputs = []
        for rid in list(self.requests):
            self.requests[rid] += 1
            finished = self.requests[rid] >= self.length
            if self.final_only and not finished:
                continue
            new = list(range(1, self.length + 1)) if self.final_only else [self.requests[rid]]
            token = SimpleNamespace(token_ids=new, logprobs=None, finish_reason="length")
            outputs.append(SimpleNamespace(request_id=rid, outputs=[token], finished=finished))
            if finished:
                del self.requests[rid]
        return outputs


class Params:
    def clone(self) -> Params:
        return self


def make_loop(engine: ScriptedEngine, version: list[int]) -> EngineLoop:
    progress = engine.requests.__getitem__ if engine.final_only else None
    return EngineLoop(
        engine, "engine 3", lambda: (version[0], None), lambda tokens, _: [-1.0] * len(tokens), progress=progress
    )


def test_requests_are_served_on_the_loop_thread_with_the_version_of_each_step() -> None:
    engine, version = ScriptedEngine(length=4), [5]
    loop = make_loop(engine, version)
    try:
        first = loop.submit([1, 2], Params())
        served = first.result(WAIT_S)
        assert served.token_ids == [1, 2, 3, 4] and served.versions == [5] * 4 and served.logprobs == [-1.0] * 4
        assert engine.threads == {"rl-vllm engine 3 loop"}
        loop.pause("keep", WAIT_S)
        second = loop.submit([1], Params())
        time.sleep(0.1)
        assert not second.done() and engine.steps == 4, "a request started while paused"
        version[0] = 6
        loop.resume()
        assert second.result(WAIT_S).versions == [6] * 4
    finally:
        loop.stop()


@pytest.mark.parametrize("final_only", [False, True], ids=["per-step outputs", "final outputs"])
def test_a_request_kept_across_a_weight_change_has_a_span_of_each_version(final_only: bool) -> None:
    """Each token's version is the one its step ran with, whether the engine hands tokens out per step or at the
    end (then the loop reads how far each request got when the weights change)."""
    engine, version = ScriptedEngine(length=8, step_s=0.02, final_only=final_only), [1]
    loop = make_loop(engine, version)
    try:
        assert loop.final_only == final_only
        future = loop.submit([1], Params())
        while engine.steps < 3:
            time.sleep(0.005)
        loop.pause("keep", WAIT_S)
        [at_change] = loop.tokens_so_far()
        version[0] = 2
        loop.resume()
        served = future.result(WAIT_S)
        assert 3 <= at_change < 8
        assert served.token_ids == list(range(1, 9))
        assert served.versions == [1] * at_change + [2] * (8 - at_change)
        assert served.spans == [(0, 1), (at_change, 2)]
    finally:
        loop.stop()


def test_tokens_so_far_read_while_serving_counts_a_request_the_engine_just_finished() -> None:
    """A request the engine finished in the step under way has left vLLM's output processor before the loop
    hands it its output; read from another thread then, it counts what it was handed so far (no KeyError)."""
    engine = ScriptedEngine(length=50, step_s=0.01, final_only=True)
    left: dict[str, int] = {}  # the output processor holds no request: each looks finished
    loop = EngineLoop(
        engine, "engine 3", lambda: (0, None), lambda tokens, _: [-1.0] * len(tokens), progress=left.__getitem__
    )
    try:
        loop.submit([1], Params())
        while engine.steps < 2:
            time.sleep(0.005)
        assert loop.tokens_so_far() == [0]
    finally:
        loop.stop()


def test_a_raising_step_fails_every_waiting_caller_naming_the_engine() -> None:
    engine = ScriptedEngine(length=10, fail_at=2)
    loop = make_loop(engine, [0])
    try:
        futures = [loop.submit([1], Params()) for _ in range(3)]
        for future in futures:
            with pytest.raises(
                EngineLoopError, match="engine 3: the engine loop failed: RuntimeError: kernel exploded"
            ):
                future.result(WAIT_S)
        with pytest.raises(EngineLoopError, match="engine 3"):
            loop.submit([1], Params())
        with pytest.raises(EngineLoopError, match="engine 3"):
            loop.pause("wait", WAIT_S)
    finally:
        loop.stop()


def test_stop_fails_queued_requests_and_ends_the_thread() -> None:
    loop = make_loop(ScriptedEngine(length=10), [0])
    loop.pause("keep", WAIT_S)
    queued = loop.submit([1], Params())
    loop.stop()
    with pytest.raises(EngineLoopError, match="engine 3: the engine was shut down"):
        queued.result(WAIT_S)
    assert not any(t.name == "rl-vllm engine 3 loop" for t in threading.enumerate())


# -- lock step (tensor_parallel_size > 1) -----------------------------------------------------------------------
@pytest.fixture
def pair() -> Iterator[dict[str, Any]]:
    """A leader and a follower loop, each over its own scripted engine, meeting in a loopback TCPStore."""
    from datetime import timedelta

    import torch.distributed as dist

    servers = [dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))]
    port = servers[0].port  # the connections below do not hold the server: a test may end it
    version = [0]
    engines = [ScriptedEngine(length=4, step_s=0.002), ScriptedEngine(length=4, step_s=0.002)]
    loops = []
    for tp_rank, engine in enumerate(engines):
        lockstep = Lockstep(
            lambda: dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=2)),
            tp_rank,
            2,
            follower_lag_s=LAG_S,
        )
        loops.append(
            EngineLoop(
                engine,
                f"engine 0 rank {tp_rank}",
                lambda: (version[0], None),
                lambda tokens, _: [-1.0] * len(tokens),
                lockstep,
                request_wait_s=0.5,
                outcome_wait_s=LAG_S,
            )
        )
    try:
        yield {"loops": loops, "engines": engines, "version": version, "servers": servers}
    finally:
        for loop in reversed(loops):
            loop.stop()


def on_both(loops: list[EngineLoop], call: Callable[[EngineLoop], Any], late_s: float = 0.0) -> list[Any]:
    """``call`` on each rank from a thread of its own (as Ray runs an actor's calls); the follower's ``late_s``
    later."""
    with ThreadPoolExecutor(2) as pool:
        leader = pool.submit(call, loops[0])
        time.sleep(late_s)
        follower = pool.submit(call, loops[1])
        return [leader.result(WAIT_S), follower.result(WAIT_S)]


def test_a_follower_makes_the_leader_s_engine_calls_however_late_its_calls_come(pair: dict) -> None:
    loops, engines, version = pair["loops"], pair["engines"], pair["version"]
    first = [loop.submit([1, 2], Params(), key="a:0") for loop in loops[:1]]
    time.sleep(0.2)  # the leader admits before the follower has the request: the follower waits for it, the leader
    # for the follower (it steps only with requests every rank has taken)
    first.append(loops[1].submit([1, 2], Params(), key="a:0"))
    served = [f.result(WAIT_S) for f in first]
    assert served[0] == served[1] and served[0].token_ids == [1, 2, 3, 4]

    # keep a request across a pause; a refit (version 1) holds both ranks at the same tick; one submitted
    # during the pause runs after resume; an abort pause restarts what runs, on both ranks alike
    engines[0].length = engines[1].length = 150  # 0.3 s: still running at the pauses
    kept = [loop.submit([7], Params(), key="b:0") for loop in loops]
    while engines[1].steps < 10:
        time.sleep(0.001)
    on_both(loops, lambda loop: loop.pause("keep", WAIT_S), late_s=0.05)
    assert [loop.state for loop in loops] == ["paused", "paused"]
    queued = [loop.submit([8], Params(), key="c:0") for loop in loops]

    def refit(loop: EngineLoop) -> int:
        with loop.held():
            steps = loop._engine.steps
            time.sleep(0.1)  # loading weights: neither rank may step
            assert loop._engine.steps == steps
            if loop is loops[0]:
                version[0] = 1
            return steps

    at_refit = on_both(loops, refit, late_s=0.05)
    assert at_refit[0] == at_refit[1], "the ranks held the engine at different steps"
    on_both(loops, lambda loop: loop.resume(recompute_kv_cache=True))
    while engines[1].steps < at_refit[1] + 5:
        time.sleep(0.001)
    on_both(loops, lambda loop: loop.pause("abort", WAIT_S))
    on_both(loops, lambda loop: loop.resume())
    results = [[f.result(WAIT_S) for f in futures] for futures in (kept, queued)]
    for leader, follower in results:
        assert leader == follower
    assert results[0][0].restarts == 1 and results[1][0].restarts == 1  # both running at the abort
    assert set(results[1][0].versions) == {1}
    assert engines[0].calls == engines[1].calls, "the ranks' engine calls diverged"
    kinds = {call[0] for call in engines[0].calls}
    assert {"add", "step", "abort", "reset"} <= kinds


def test_a_request_the_follower_never_gets_fails_its_loop_naming_the_request(pair: dict) -> None:
    loops = pair["loops"]
    leader = loops[0].submit([1], Params(), key="lost:0")
    started = time.monotonic()
    waiting = loops[1].submit([2], Params(), key="other:0")  # never admitted: the leader does not know it
    with pytest.raises(EngineLoopError, match=r"engine 0 rank 1: the leading rank admitted request 'lost:0'"):
        waiting.result(WAIT_S)
    assert time.monotonic() - started < 3.0
    # the leader fails too instead of stepping into a collective the follower would not join
    with pytest.raises(
        EngineLoopError, match=r"engine 0 rank 0: .*tensor-parallel rank 1 failed at tick 0: .*'lost:0'"
    ):
        leader.result(WAIT_S)
    assert pair["engines"][0].steps == 0


def test_a_leader_s_timed_out_pause_is_the_follower_s_too(pair: dict) -> None:
    loops, engines = pair["loops"], pair["engines"]
    engines[0].length = engines[1].length = 10_000
    [loop.submit([1], Params(), key="long:0") for loop in loops]
    while engines[1].steps < 2:
        time.sleep(0.001)
    outcomes = on_both(loops, lambda loop: _raised(lambda: loop.pause("wait", 0.01)))
    assert all(isinstance(o, TimeoutError) and "engine 0 rank 0: not paused within 0.01s" in str(o) for o in outcomes)
    assert loops[0].state == "serving"


def _raised(call: Callable[[], Any]) -> Any:
    try:
        return call()
    except Exception as exc:  # noqa: BLE001 - returned for the test to compare
        return exc


def test_a_follower_whose_leader_s_process_ends_fails_its_requests_naming_it(pair: dict) -> None:
    """The store lives in tensor-parallel rank 0's process: when it ends, a follower waiting for a tick fails its
    requests at once (no hang), naming itself and the leader."""
    loops = pair["loops"]
    served = [loop.submit([1], Params(), key="a:0") for loop in loops]
    assert [f.result(WAIT_S).token_ids for f in served] == [[1, 2, 3, 4]] * 2
    orphan = loops[1].submit([5], Params(), key="b:0")
    started = time.monotonic()
    pair["servers"].clear()  # the leader's process ends (its store with it)
    with pytest.raises(EngineLoopError, match=r"engine 0 rank 1: .*tick channel to tensor-parallel rank 0 broke"):
        orphan.result(WAIT_S)
    assert time.monotonic() - started < 3.0


def test_a_follower_whose_step_raises_fails_the_leader_s_requests_naming_it(pair: dict) -> None:
    """The follower reports its loop's failure on the channel: the leader stops at its next tick (it would block
    in the step's collective otherwise) and every request waiting on it fails naming the follower and the cause."""
    loops, engines = pair["loops"], pair["engines"]
    engines[0].length = engines[1].length = 10_000
    engines[1].fail_at = 5
    running = [loop.submit([1], Params(), key="long:0") for loop in loops]
    queued = [loop.submit([2], Params(), key="later:0") for loop in loops][0]
    started = time.monotonic()
    for future in (running[0], queued):
        with pytest.raises(
            EngineLoopError,
            match=r"engine 0 rank 0: the engine loop failed: FollowerFailed: tensor-parallel rank 1 failed at tick "
            r"\d+: RuntimeError: kernel exploded",
        ):
            future.result(WAIT_S)
    assert time.monotonic() - started < 2.0
    assert engines[0].steps <= engines[1].steps + 1, "the leader kept stepping without its follower"
    with pytest.raises(EngineLoopError, match="engine 0 rank 1: the engine loop failed: RuntimeError: kernel"):
        running[1].result(WAIT_S)


def test_a_silent_follower_fails_the_leader_within_the_lag_bound(pair: dict) -> None:
    """A follower that reports nothing (its process died, or it hangs) is named once ``follower_lag_s`` passes;
    the leader does not step again meanwhile."""
    loops, engines = pair["loops"], pair["engines"]
    engines[0].length = engines[1].length = 10_000
    stuck = engines[1].stuck = threading.Event()
    try:
        running = loops[0].submit([1], Params(), key="long:0")
        loops[1].submit([1], Params(), key="long:0")
        while engines[0].steps < 1:
            time.sleep(0.001)
        started = time.monotonic()
        with pytest.raises(
            EngineLoopError,
            match=rf"engine 0 rank 0: .*tensor-parallel rank 1 reported no progress on tick 0 within {LAG_S}s",
        ):
            running.result(WAIT_S)
        assert LAG_S - 0.1 < time.monotonic() - started < LAG_S + 1.0
        assert engines[0].steps == 1, "the leader stepped past a silent follower"
    finally:
        stuck.set()


def test_a_follower_waits_for_a_missing_leader_outcome_within_the_bound(pair: dict) -> None:
    """A follower's pause mirrors the leader's: when the leader never tells its outcome (it never got the call),
    the follower's call ends in a TimeoutError naming the engine and what it waited for, not a hang; a pause's
    own ``timeout_s`` extends the bound."""
    loops = pair["loops"]
    started = time.monotonic()
    with pytest.raises(
        TimeoutError,
        match=r"engine 0 rank 1: the leading rank \(tensor-parallel rank 0\) told no outcome of its pause call #0 "
        rf"within {LAG_S + 0.5}s",
    ):
        loops[1].pause("keep", 0.5)
    assert LAG_S + 0.4 < time.monotonic() - started < LAG_S + 2.0
