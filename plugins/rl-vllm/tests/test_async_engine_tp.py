"""``vllm_cfg.async_engine: true`` with ``tensor_parallel_size: 2``: one engine over two CPU bundles whose ranks'
engine loops run in lock step (``rl_vllm.lockstep``: rank 0 leads, rank 1 follows its ticks).

One class-scoped engine serves this module's checks; the generation and lifecycle kits run (slow) on an engine of
their own. The reference is a
float32 Hugging Face forward of the same weights (an engine sharded over two ranks all-reduces partial sums: its
logprobs equal HF's to 1e-4, as in ``test_refit_tp_engines.py``) and the engine's own blocking batch; lock step
shows as both ranks having run the same steps and holding the same tokens whenever the engine is paused, and as
no call hanging.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray
import torch
from test_async_engine import LONG, PROMPTS, SAME, generated, hf_logprobs, prompts, sampling

from rl_vllm.generation import VllmGeneration
from rl_vllm.refit import EngineStaleError
from rlcore.config import load_config_dict
from rlcore.data import BatchedDataDict
from rlcore.refit.shared_memory import stream_to_receiver
from rlcore.testing.conformance import EngineLifecycleConformance, GenerationBackendConformance
from rlcore.testing.oracle import load_hf_model
from rlcore.testing.pytest_plugin import ClusterPool

TP = 2
ATOL = 1e-4  # float32 engine over two ranks against the HF float32 forward
BUCKET = 32 << 10
SHORT = 8
TP_ASYNC_ENGINE = {"kv_cache_space_gb": 0.0625, "max_model_len": 256, "tensor_parallel_size": TP, "async_engine": True}


@pytest.fixture(scope="class")
def versions(tiny_model_dir: str) -> dict[str, Any]:
    """The tiny model's weights (version 0) and other weights (version 1), each with its HF float32 model."""
    v0 = load_hf_model(tiny_model_dir)
    weights0 = {k: v.detach().clone() for k, v in v0.state_dict().items()}
    generator = torch.Generator().manual_seed(7)
    weights1 = {k: v + 0.02 * torch.randn(v.shape, generator=generator) for k, v in weights0.items()}
    v1 = load_hf_model(tiny_model_dir)
    v1.load_state_dict(weights1)
    return {"hf": [v0, v1], "weights": [weights0, weights1]}


@pytest.fixture(scope="class")
def tp_engine(ray_session: None, tiny_model_dir: str, tiny_tokenizer: Any, versions: dict) -> Iterator[dict[str, Any]]:
    """One engine of tensor_parallel_size 2 for the class, greedy requests of SHORT tokens by default."""
    generation = {
        "backend": "vllm",
        "max_new_tokens": SHORT,
        "pad_token_id": tiny_tokenizer.pad_token_id,
        "vllm_cfg": TP_ASYNC_ENGINE,
    }
    cfg = load_config_dict(
        {
            "policy": {
                "backend": "reference",
                "model_name": tiny_model_dir,
                "precision": "float32",
                "generation": generation,
            }
        }
    ).policy.generation
    clusters = ClusterPool()
    engine = None
    try:
        started = time.perf_counter()
        engine = VllmGeneration(clusters(TP), cfg, name_prefix="tp-async-vllm")
        print(f"tp={TP} async engine started in {time.perf_counter() - started:.1f}s")
        yield {"engine": engine, **versions}
    finally:
        if engine is not None:
            engine.shutdown()
        clusters.shutdown()


def stream_weights(engine: VllmGeneration, weights: dict[str, torch.Tensor]) -> list[dict[str, int]]:
    """Stream ``weights`` into every rank of the engine (each rank's loaders read its shards; after the first
    refit a rank is sent only those); per rank, the fingerprints of what the sender wrote to it."""
    info = {k: (tuple(v.shape), str(v.dtype)) for k, v in weights.items()}
    engine.prepare_refit_info(info)
    endpoints = engine.refit_endpoints()
    receivers = engine.update_weights_via_ipc_zmq(BUCKET)
    sent = [
        stream_to_receiver(((k, weights[k]) for k in info), info, *endpoints[rank], BUCKET, torch.device("cpu"))
        for rank in range(engine.refit_world_size())
    ]
    ray.get(receivers, timeout=120)
    return [s.fingerprints for s in sent]


def refit(engine: VllmGeneration, weights: dict[str, torch.Tensor], version: int) -> None:
    stream_weights(engine, weights)
    engine.set_weight_version(version)


def ranks(engine: VllmGeneration) -> list[dict[str, Any]]:
    return engine._all("serving_state")


def in_lock_step(engine: VllmGeneration) -> dict[str, Any]:
    """Both ranks' loop state (read while paused): the same steps run and the same tokens so far."""
    leader, follower = ranks(engine)
    assert leader["state"] == follower["state"] == "paused", (leader, follower)
    assert leader["steps"] == follower["steps"] and leader["tokens_so_far"] == follower["tokens_so_far"], (
        leader,
        follower,
    )
    return leader


def after_steps(engine: VllmGeneration, count: int, timeout_s: float = 60.0) -> None:
    start, deadline = ranks(engine)[0]["steps"], time.monotonic() + timeout_s
    while ranks(engine)[0]["steps"] < start + count:
        assert time.monotonic() < deadline, "the engine did not step"
        time.sleep(0.01)


def done(handle: Any, timeout_s: float = 0.0) -> bool:
    ready, _ = ray.wait(list(handle.refs), num_returns=len(handle.refs), timeout=timeout_s)
    return len(ready) == len(handle.refs)


def long_request(engine: VllmGeneration, prompt: list[int] = PROMPTS[0]) -> Any:
    with sampling(engine, max_new_tokens=LONG):
        return engine.generate_async(prompts([prompt]), greedy=True)


def short_request(engine: VllmGeneration, rows: list[list[int]]) -> Any:
    """Greedy, 8 new tokens at most (the class's config asks 240, for the lifecycle kit)."""
    with sampling(engine, max_new_tokens=SHORT):
        return engine.generate_async(prompts(rows), greedy=True)


def hf_agreement(model: Any, out: BatchedDataDict) -> tuple[float, int]:
    """Max |engine - HF| logprob over the generated tokens, and how many generated tokens are not HF's argmax
    (counted where HF's top two differ by more than 1e-3: a near tie may go either way in float32)."""
    ids, lengths = out["output_ids"], out["unpadded_sequence_lengths"]
    with torch.no_grad():
        expected = hf_logprobs(model, out)
        valid = (torch.arange(ids.shape[1])[None, :] < lengths[:, None]).long()
        logits = model(input_ids=ids, attention_mask=valid, use_cache=False).logits.float()
    positions = torch.arange(ids.shape[1])[None, :]
    start = lengths - out["generation_lengths"]
    generated_at = (positions >= start[:, None]) & (positions < lengths[:, None])
    assert bool(generated_at.any()), "nothing was generated: the comparison would be vacuous"
    err = float((out["logprobs"] - expected)[generated_at].abs().max())
    top2 = logits[:, :-1].topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 1e-3
    argmax = logits[:, :-1].argmax(-1)
    wrong = generated_at[:, 1:] & clear & (argmax != ids[:, 1:])
    return err, int(wrong.sum())


@pytest.mark.slow  # 1-2.5 min on 2 busy cores; the lock step itself is tested fast in test_engine_loop.py
class TestTensorParallelAsyncEngine:
    """This module's checks, on the class's engine (``tp_engine``)."""

    @pytest.fixture(autouse=True)
    def serving_again(self, tp_engine: dict) -> Iterator[None]:
        """A test that failed while paused must not leave the shared engine paused for the next one."""
        yield
        if tp_engine["engine"].worker_group.workers and ranks(tp_engine["engine"])[0]["state"] != "serving":
            tp_engine["engine"].resume_generation()

    def test_greedy_outputs_are_the_hf_model_s(self, tp_engine: dict) -> None:
        engine = tp_engine["engine"]
        assert engine.num_engines == 1 and engine.refit_world_size() == TP
        assert all(info["async_engine"] for info in engine.engine_info)
        out = engine.generate(prompts(PROMPTS), greedy=True)  # the first: ~20 s of CPU warm-up, as a sync engine's
        err, wrong = hf_agreement(tp_engine["hf"][0], out)
        assert err <= ATOL and wrong == 0, (err, wrong)
        on_tokens = out["generation_weight_versions"] >= 0
        assert int(on_tokens.sum()) == int(out["generation_lengths"].sum()) > 0
        assert out["generation_weight_versions"][on_tokens].eq(0).all()

    def test_sample_groups_submitted_together_come_ready_first_and_equal_the_batch(self, tp_engine: dict) -> None:
        engine = tp_engine["engine"]
        batch = engine.collect(short_request(engine, PROMPTS))
        long = long_request(engine, PROMPTS[1])
        groups = [short_request(engine, [p]) for p in PROMPTS]
        order, outputs = [], {}
        for index, out in engine.as_completed([long, *groups], timeout_s=120):
            order.append(index)
            outputs[index] = out
        assert order[-1] == 0, f"the {LONG}-token request was not last: {order}"
        for row in range(len(PROMPTS)):
            own = outputs[row + 1]
            assert generated(own)[0] == generated(batch, row)[0], f"group {row}: other tokens than the batch's"
            assert float((generated(own)[1] - generated(batch, row)[1]).abs().max()) <= SAME

    def test_keep_pause_refit_resume_gives_two_versions_in_lock_step(self, tp_engine: dict) -> None:
        """pause('keep') mid-generation, refit other weights into both ranks (version 1), resume with
        recompute: the sample's tokens are a v0 span then a v1 span, each span's logprobs HF's under its weights;
        the ranks stayed in lock step, and the engine serves afterwards (on v1)."""
        engine, hf = tp_engine["engine"], tp_engine["hf"]
        kept = long_request(engine)
        after_steps(engine, 8)
        engine.pause_generation("keep", timeout_s=30)
        [at_refit] = in_lock_step(engine)["tokens_so_far"]
        refit(engine, tp_engine["weights"][1], version=1)
        in_lock_step(engine)
        engine.resume_generation(recompute_kv_cache=True)
        out = engine.collect(kept)
        after = engine.collect(short_request(engine, PROMPTS))
        refit(engine, tp_engine["weights"][0], version=0)  # back to v0 for the tests after this one
        tokens, logprobs, versions = generated(out)
        split = int((versions == 0).sum())
        assert split == at_refit >= 8 and versions[:split].eq(0).all() and versions[split:].eq(1).all(), (
            versions.tolist()
        )
        assert len(tokens) > split, "no token after the refit: the request ended before it"
        start = int(out["unpadded_sequence_lengths"][0]) - len(tokens)
        under = [hf_logprobs(model, out)[0, start : start + len(tokens)] for model in hf]
        assert float((under[0][split:] - under[1][split:]).abs().max()) > 1e-3, "v0 and v1 agree: vacuous"
        assert float((logprobs[:split] - under[0][:split]).abs().max()) <= ATOL
        assert float((logprobs[split:] - under[1][split:]).abs().max()) <= ATOL
        err, wrong = hf_agreement(hf[1], after)
        assert err <= ATOL and wrong == 0 and after["generation_weight_versions"].max() == 1, (err, wrong)

    def test_abort_and_wait_pauses_and_a_request_submitted_while_paused(self, tp_engine: dict) -> None:
        engine = tp_engine["engine"]
        whole = engine.collect(long_request(engine))
        aborted = long_request(engine)
        after_steps(engine, 5)
        engine.pause_generation("abort", timeout_s=30)
        in_lock_step(engine)
        queued = short_request(engine, [PROMPTS[2]])
        parked = ranks(engine)[0]["steps"]
        time.sleep(0.3)
        assert not done(queued) and ranks(engine)[0]["steps"] == parked, "a request started while paused"
        engine.resume_generation()
        out = engine.collect(aborted)
        assert torch.equal(out["output_ids"], whole["output_ids"]), "the restarted request's tokens differ"
        assert float((out["logprobs"] - whole["logprobs"]).abs().max()) <= SAME
        assert done(queued, timeout_s=60), "a request submitted during the pause did not finish after resume"

        running = long_request(engine)
        after_steps(engine, 3)
        engine.pause_generation("wait", timeout_s=120)
        assert in_lock_step(engine)["requests"] == 0, "pause('wait') returned undrained"
        assert done(running, timeout_s=10)
        engine.resume_generation()
        assert engine.collect(short_request(engine, [PROMPTS[3]]))["generation_lengths"][0] > 0

    def test_a_killed_follower_fails_the_engine_s_requests_naming_it(self, tp_engine: dict) -> None:
        """Last in the class (it ends the engine): the follower's process dies mid-generation; ``as_completed``
        raises at once, naming the dead rank (what ``rlcore.run.engine_recovery`` restarts the engine on), instead
        of waiting for the leader's call (its step's collective would wait for the dead rank)."""
        from rlcore.distributed import WorkerError

        engine = tp_engine["engine"]
        running = long_request(engine)
        after_steps(engine, 3)
        started = time.monotonic()
        ray.kill(engine.worker_group.workers[1], no_restart=True)
        with pytest.raises(WorkerError, match=r"worker tp-async-vllm-rank1 \(rank 1\) died") as raised:
            list(engine.as_completed([running], timeout_s=120))
        elapsed = time.monotonic() - started
        print(f"the killed follower was named {elapsed:.2f}s after its death: {raised.value}")
        assert elapsed < 30
        assert not engine.worker_group.workers, "the engine's other rank was left running"


@pytest.mark.slow
class TestTensorParallelAsyncEngineKits(GenerationBackendConformance, EngineLifecycleConformance):
    """The generation kit's checks (output format, HF agreement) and the lifecycle kit's (pause modes, submits
    while paused or draining, identity refits while paused; every output must equal the unpaused one; each rank's
    refit fingerprints equal those of the slices it was sent) on an engine of tensor_parallel_size 2 of its own.
    Slow: about 3 minutes on two loaded cores (its 240-token requests run on two ranks); the class above covers
    the same lock-step paths."""

    backend_name = "vllm"
    world_size = TP
    max_new_tokens = 240  # the lifecycle kit's requests must still be running when it pauses, 0.15 s in
    stale_errors = (EngineStaleError,)
    lifecycle_timeout_s = 120.0
    lifecycle_settle_s = 0.15
    lifecycle_paused_probe_s = 0.3

    def generation_overrides(self) -> dict:
        return {"vllm_cfg": TP_ASYNC_ENGINE}

    def make_generation(self, cluster: Any, config: Any) -> Any:
        started = time.perf_counter()
        engine = VllmGeneration(cluster, config, name_prefix="tp-async-vllm")
        print(f"tp={TP} async engine started in {time.perf_counter() - started:.1f}s")
        return engine

    def refit(self, engine: Any, state_dict: dict[str, torch.Tensor], version: int) -> list[dict[str, int]]:
        """The lifecycle kit's refits: the state dict into every rank (the kit names the version); what each rank
        was sent, for the identity-refit check to compare each rank's fingerprints with (a rank holds slices)."""
        return stream_weights(engine, state_dict)

    def test_plugin_module_is_light(self, kit_registry: Any) -> None:
        pytest.skip("checked once, by test_generation.py's TestVllmBackend")

    def test_spec_is_valid(self, backend_spec: Any) -> None:
        pytest.skip("checked once, by test_generation.py's TestVllmBackend")
