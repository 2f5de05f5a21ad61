"""``vllm_cfg.async_engine``: real vLLM engines served by the engine loop, on CPU, with the tiny float32 Llama.

One class-scoped pair on one bundle: an ``async_engine`` engine and a sync one (the reference its outputs must
equal). Refits stream HF weights with the shared-memory sender the refit tests use; logprobs are checked against
a float32 Hugging Face forward under the weights of each span of versions.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray
import torch

from rl_vllm.generation import VllmGeneration
from rlcore.config import load_config_dict
from rlcore.data import BatchedDataDict
from rlcore.refit.shared_memory import stream_to_receiver
from rlcore.testing.oracle import hf_token_logprobs, load_hf_model
from rlcore.testing.pytest_plugin import ClusterPool

ATOL = 1e-4  # engine vs HF float32 forward, as the other logprob tests
SAME = 1e-5  # async vs sync engine: the same kernels on the same batch
LONG = 96  # tokens of a request long enough to be paused mid-way
SMALL_BUCKET = 32 << 10


def config(model_dir: str, pad_id: int, async_engine: bool, max_new: int = 8) -> Any:
    return load_config_dict(
        {
            "policy": {
                "backend": "reference",
                "model_name": model_dir,
                "precision": "float32",
                "generation": {
                    "backend": "vllm",
                    "max_new_tokens": max_new,
                    "pad_token_id": pad_id,
                    "vllm_cfg": {
                        "kv_cache_space_gb": 0.0625,
                        "max_model_len": 128,
                        "async_engine": async_engine,
                    },
                },
            },
        }
    ).policy.generation


@pytest.fixture(scope="class")
def engines(ray_session: None, tiny_model_dir: str, tiny_tokenizer: Any) -> Iterator[dict]:
    clusters = ClusterPool()
    cluster = clusters(1, max_colocated_worker_groups=2)
    made: list[VllmGeneration] = []
    try:
        pad = tiny_tokenizer.pad_token_id
        made.append(VllmGeneration(cluster, config(tiny_model_dir, pad, True), name_prefix="async-vllm"))
        v0 = load_hf_model(tiny_model_dir)
        weights0 = {k: v.detach().clone() for k, v in v0.state_dict().items()}
        generator = torch.Generator().manual_seed(7)
        weights1 = {k: v + 0.02 * torch.randn(v.shape, generator=generator) for k, v in weights0.items()}
        v1 = load_hf_model(tiny_model_dir)
        v1.load_state_dict(weights1)
        yield {"async": made[0], "hf": [v0, v1], "weights": [weights0, weights1], "cluster": cluster, "made": made}
    finally:
        for engine in made:
            engine.shutdown()
        clusters.shutdown()


@pytest.fixture(scope="class")
def sync_engine(engines: dict, tiny_model_dir: str, tiny_tokenizer: Any) -> VllmGeneration:
    """A sync engine beside the async one (same bundle), started only by the tests that compare with it; the
    ``engines`` fixture shuts it down."""
    cfg = config(tiny_model_dir, tiny_tokenizer.pad_token_id, False)
    engine = VllmGeneration(engines["cluster"], cfg, name_prefix="sync-vllm")
    engines["made"].append(engine)
    return engine


@contextlib.contextmanager
def sampling(engine: VllmGeneration, **changes: Any) -> Iterator[None]:
    saved = engine.cfg
    engine.cfg = saved.model_copy(update=changes)
    try:
        yield
    finally:
        engine.cfg = saved


def prompts(rows: list[list[int]]) -> BatchedDataDict:
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
    return BatchedDataDict(input_ids=ids, input_lengths=torch.tensor([len(r) for r in rows]))


PROMPTS = [[1, 72, 101, 108], [1, 80, 51], [1, 33, 34, 35, 36, 37], [1, 90]]
CACHED = [1, *range(40, 80)]  # 41 tokens: one full KV block of 32 (rl_vllm.worker.CPU_BLOCK_SIZE) is prefix-cached


def refit(engine: VllmGeneration, weights: dict[str, torch.Tensor], version: int) -> None:
    """Stream ``weights`` into every engine with the refit tests' shared-memory sender; name them ``version``."""
    info = {k: (tuple(v.shape), str(v.dtype)) for k, v in weights.items()}
    engine.prepare_refit_info(info)
    endpoints = engine.refit_endpoints()
    receivers = engine.update_weights_via_ipc_zmq()
    for rank in range(engine.num_engines):
        stream_to_receiver(((k, weights[k]) for k in info), info, *endpoints[rank], SMALL_BUCKET, torch.device("cpu"))
    ray.get(receivers)
    engine.set_weight_version(version)


def steps(engine: VllmGeneration) -> int:
    return engine._all("serving_state")[0]["steps"]


def after_steps(engine: VllmGeneration, count: int, timeout_s: float = 30.0) -> None:
    """Return once the engine has stepped ``count`` more times."""
    start, deadline = steps(engine), time.monotonic() + timeout_s
    while steps(engine) < start + count:
        assert time.monotonic() < deadline, "the engine did not step"
        time.sleep(0.005)


def done(handle: Any, timeout_s: float = 0.0) -> bool:
    ready, _ = ray.wait(list(handle.refs), num_returns=len(handle.refs), timeout=timeout_s)
    return len(ready) == len(handle.refs)


def generated(out: BatchedDataDict, row: int = 0) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    start, end = (
        int(out["unpadded_sequence_lengths"][row] - out["generation_lengths"][row]),
        int(out["unpadded_sequence_lengths"][row]),
    )
    return (
        out["output_ids"][row, start:end].tolist(),
        out["logprobs"][row, start:end],
        out["generation_weight_versions"][row, start:end],
    )


def hf_logprobs(model: Any, out: BatchedDataDict) -> torch.Tensor:
    with torch.no_grad():
        return hf_token_logprobs(
            model, {"input_ids": out["output_ids"], "input_lengths": out["unpadded_sequence_lengths"]}
        )


def long_request(engine: VllmGeneration, prompt: list[int] = PROMPTS[0]) -> Any:
    with sampling(engine, max_new_tokens=LONG):
        return engine.generate_async(prompts([prompt]), greedy=True)


class TestAsyncEngine:
    @pytest.fixture(autouse=True)
    def serving_again(self, engines: dict) -> Iterator[None]:
        """A test that failed while paused must not leave the shared engine paused for the next one."""
        yield
        if engines["async"]._all("serving_state")[0]["state"] != "serving":
            engines["async"].resume_generation()

    @pytest.mark.slow
    def test_async_engine_outputs_equal_the_sync_engine_s(self, engines: dict, sync_engine: VllmGeneration) -> None:
        """Slow: a second engine costs ~20-40 s on two loaded cores."""
        engines = {**engines, "sync": sync_engine}
        data = prompts(PROMPTS)
        for greedy in (True, False):
            if not greedy:
                data["sampling_seeds"] = torch.tensor([11, 12, 13, 14])
            with sampling(engines["async"], temperature=1.0), sampling(engines["sync"], temperature=1.0):
                a, s = engines["async"].generate(data, greedy=greedy), engines["sync"].generate(data, greedy=greedy)
            assert torch.equal(a["output_ids"], s["output_ids"]), f"greedy={greedy}: other tokens"
            assert float((a["logprobs"] - s["logprobs"]).abs().max()) <= SAME
            assert torch.equal(a["generation_weight_versions"], s["generation_weight_versions"])
            on_tokens = a["generation_weight_versions"] >= 0
            assert int(on_tokens.sum()) == int(a["generation_lengths"].sum()) > 0
            assert a["weight_version"].tolist() == [0] * 4

    def test_a_short_request_after_a_long_one_comes_first(self, engines: dict) -> None:
        engine = engines["async"]
        long = long_request(engine)
        with sampling(engine, max_new_tokens=2):
            short = engine.generate_async(prompts([PROMPTS[1]]), greedy=True)
        order = [index for index, _ in engine.as_completed([long, short], timeout_s=60)]
        assert order == [1, 0]

    def test_sample_groups_submitted_together_run_as_one_streaming_call(self, engines: dict) -> None:
        """``generate_groups_async``: one streaming call admits every group at one engine step (the engine steps
        as often as the longest completion has tokens, no more) and hands each back as it finishes, before a
        long request submitted earlier, mixed in one ``as_completed``; each group's output is the one its own
        ``generate_async`` gives."""
        engine = engines["async"]
        groups = [prompts([p, p]) for p in PROMPTS[1:]]  # a group: two samples of one prompt
        alone = [engine.collect(engine.generate_async(g, greedy=True)) for g in groups]
        before = steps(engine)
        together = [engine.collect(h) for h in reversed(engine.generate_groups_async(groups, greedy=True))][::-1]
        longest = max(int(out["generation_lengths"].max()) for out in together)
        assert steps(engine) - before == longest > 1, "the groups were not admitted at one step"
        long = long_request(engine)
        handles = [long, *engine.generate_groups_async(groups, greedy=True)]
        order, outputs = [], {}
        for index, out in engine.as_completed(handles, timeout_s=60):
            order.append(index)
            outputs[index] = out
        assert order[-1] == 0 and sorted(order) == [0, 1, 2, 3], order
        for group, own in enumerate(alone):
            for out in (together[group], outputs[group + 1]):
                assert torch.equal(out["output_ids"], own["output_ids"]), f"group {group}: other tokens"
                assert float((out["logprobs"] - own["logprobs"]).abs().max()) <= SAME
                assert out["weight_version"].tolist() == [0, 0]
        assert engine._outstanding == [0], "the routing's count of rows in flight was not given back"

    def test_pause_wait_drains_then_parks_and_queues_new_requests(self, engines: dict) -> None:
        engine = engines["async"]
        running = long_request(engine)
        after_steps(engine, 3)
        engine.pause_generation("wait", timeout_s=60)
        state = engine._all("serving_state")[0]
        assert state["state"] == "paused" and state["requests"] == 0, f"pause('wait') returned undrained: {state}"
        assert done(running, timeout_s=10)
        queued = long_request(engine, PROMPTS[2])
        parked = steps(engine)
        time.sleep(0.3)
        assert not done(queued) and steps(engine) == parked, "a request started while paused"
        engine.resume_generation()
        assert done(queued, timeout_s=30), "a request queued during the pause did not finish after resume"

    def test_pause_keep_continues_where_it_stopped(self, engines: dict) -> None:
        engine = engines["async"]
        whole = engine.collect(long_request(engine))
        kept = long_request(engine)
        after_steps(engine, 5)
        engine.pause_generation("keep", timeout_s=10)
        parked = steps(engine)
        time.sleep(0.3)
        assert not done(kept) and steps(engine) == parked, "the engine stepped while paused"
        engine.resume_generation()
        out = engine.collect(kept)
        assert torch.equal(out["output_ids"], whole["output_ids"])
        assert float((out["logprobs"] - whole["logprobs"]).abs().max()) <= SAME

    def test_pause_abort_restarts_the_request_and_returns_one_whole_completion(self, engines: dict) -> None:
        engine = engines["async"]
        whole = engine.collect(long_request(engine))
        first = steps(engine)
        aborted = long_request(engine)
        after_steps(engine, 10)
        engine.pause_generation("abort", timeout_s=10)
        engine.resume_generation()
        out = engine.collect(aborted)
        assert torch.equal(out["output_ids"], whole["output_ids"])
        assert float((out["logprobs"] - whole["logprobs"]).abs().max()) <= SAME
        tokens = int(out["generation_lengths"][0])
        assert steps(engine) - first >= tokens + 10, "the aborted request was not generated again from its prompt"

    def test_a_pause_that_cannot_drain_in_time_names_the_engine_and_serving_goes_on(self, engines: dict) -> None:
        engine = engines["async"]
        running = long_request(engine)
        after_steps(engine, 2)
        with pytest.raises(TimeoutError, match="engine 0: not paused within 0.01s"):
            engine.pause_generation("wait", timeout_s=0.01)
        assert done(running, timeout_s=30)
        assert engine._all("serving_state")[0]["state"] == "serving"

    @pytest.mark.slow
    def test_the_sync_engine_has_no_pause(self, engines: dict, sync_engine: VllmGeneration) -> None:
        with pytest.raises(RuntimeError, match="vllm_cfg.async_engine: true"):
            sync_engine.pause_generation("keep")
        assert engines["async"].continuous_serving and not sync_engine.continuous_serving

    def test_outputs_carry_the_version_of_every_generated_token(self, engines: dict) -> None:
        """Default-suite check of the output format (the slow test compares the tokens with a sync engine)."""
        data = prompts(PROMPTS)
        out = engines["async"].generate(data, greedy=True)
        on_tokens = out["generation_weight_versions"] >= 0
        assert int(on_tokens.sum()) == int(out["generation_lengths"].sum()) > 0
        assert out["generation_weight_versions"][on_tokens].eq(0).all()
        assert out["weight_version"].tolist() == [0] * 4
        start = data["input_lengths"]
        for row in range(4):
            assert not on_tokens[row, : int(start[row])].any()  # -1 at the prompt

    @pytest.mark.parametrize("recompute", [True, False])
    def test_a_refit_in_flight_gives_spans_of_versions(self, engines: dict, recompute: bool) -> None:
        """The issue's 'done when': pause('keep') mid-generation, refit other weights, version 1, resume. The
        sample's tokens are a v0 span then a v1 span, split where the refit landed; each span's logprobs are an
        HF float32 forward's under its weights (with recompute_kv_cache; without, the v1 span is reported)."""
        engine = engines["async"]
        kept = long_request(engine)
        after_steps(engine, 8)
        engine.pause_generation("keep", timeout_s=10)
        state = engine._all("serving_state")[0]
        assert state["final_only"], "the engine's per-request progress was not readable: per-step outputs"
        [at_refit] = state["tokens_so_far"]  # the refit log: where it lands
        refit(engine, engines["weights"][1], version=1)
        engine.resume_generation(recompute_kv_cache=recompute)
        out = engine.collect(kept)
        refit(engine, engines["weights"][0], version=0)  # back to v0 for the tests after this one
        tokens, logprobs, versions = generated(out)
        split = int((versions == 0).sum())
        assert split == at_refit >= 8 and versions[:split].eq(0).all() and versions[split:].eq(1).all(), (
            versions.tolist()
        )
        assert len(tokens) > split, "no token after the refit: the request ended before it"
        assert out["weight_version"].tolist() == [0]  # the oldest span
        start = int(out["unpadded_sequence_lengths"][0]) - len(tokens)
        under = [hf_logprobs(model, out)[0, start : start + len(tokens)] for model in engines["hf"]]
        v0_err = float((logprobs[:split] - under[0][:split]).abs().max())
        v1_err = float((logprobs[split:] - under[1][split:]).abs().max())
        v1_vs_v0 = float((under[0][split:] - under[1][split:]).abs().max())
        print(
            f"recompute={recompute}: split {split}/{len(tokens)}, |v0 span - HF v0| {v0_err:.2e}, "
            f"|v1 span - HF v1| {v1_err:.2e}, |HF v1 - HF v0| on the v1 span {v1_vs_v0:.2e}"
        )
        assert v0_err <= ATOL
        assert v1_vs_v0 > 1e-3, "the two weight versions give the same logprobs: vacuous"
        if recompute:
            assert v1_err <= ATOL
        else:
            assert v1_err > ATOL, "without recompute the v1 span should follow the old KV cache"

    def test_a_refit_sent_unpaused_lets_running_requests_finish_on_the_old_weights(self, engines: dict) -> None:
        """The safety net for callers that do not pause (sync GRPO): the refit pauses in 'wait' mode itself."""
        engine = engines["async"]
        whole = engine.collect(long_request(engine))
        running = long_request(engine)
        after_steps(engine, 3)
        refit(engine, engines["weights"][1], version=1)  # not paused: drains, refits, resumes
        out = engine.collect(running)
        after = engine.generate(prompts([PROMPTS[0]]), greedy=True)
        refit(engine, engines["weights"][0], version=0)
        assert engine._all("serving_state")[0]["state"] == "serving"
        assert torch.equal(out["output_ids"], whole["output_ids"]) and generated(out)[2].eq(0).all()
        tokens, logprobs, versions = generated(after)
        start = int(after["unpadded_sequence_lengths"][0]) - len(tokens)
        assert versions.eq(1).all()
        assert (
            float((logprobs - hf_logprobs(engines["hf"][1], after)[0, start : start + len(tokens)]).abs().max()) <= ATOL
        )

    def test_a_request_after_a_refit_reuses_no_prefix_cached_by_old_weights(self, engines: dict) -> None:
        """A v0 request is kept across the refit, so vLLM cannot reset the prefix cache (its blocks are in use);
        a new request with a prompt computed under v0 must still get v1 logprobs from its first token."""
        engine = engines["async"]
        cached = prompts([CACHED])
        engine.generate(cached, greedy=True)  # CACHED's full blocks now in the prefix cache, computed by v0
        kept = long_request(engine)
        after_steps(engine, 4)
        engine.pause_generation("keep", timeout_s=10)
        refit(engine, engines["weights"][1], version=1)
        engine.resume_generation()
        fresh = engine.generate(cached, greedy=True)
        engine.collect(kept)
        refit(engine, engines["weights"][0], version=0)
        tokens, logprobs, versions = generated(fresh)
        start = int(fresh["unpadded_sequence_lengths"][0]) - len(tokens)
        expected = hf_logprobs(engines["hf"][1], fresh)[0, start : start + len(tokens)]
        assert versions.eq(1).all()
        assert float((logprobs - expected).abs().max()) <= ATOL
