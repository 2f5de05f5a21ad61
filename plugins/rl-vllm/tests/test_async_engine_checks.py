"""``vllm_cfg.async_engine`` before anything starts: in-flight weight updates need it (one line naming the key and
the fix), a tensor-parallel engine runs it too (accepted when the section is validated); and how
the driver routes a sample group (against a recording stand-in for the engines: no engine starts here)."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from rl_vllm.checks import check_http_server, check_in_flight_updates
from rl_vllm.config import VllmConfig
from rlcore.config import load_config, resolve
from rlcore.distributed import Calls

TINY = str(Path(__file__).parents[3] / "src" / "rlcore" / "examples" / "grpo_tiny.yaml")


def resolved(*overrides: str):
    return resolve(load_config(TINY, ["policy.generation.backend=vllm", *overrides]), run=False)


def test_in_flight_weight_updates_without_the_async_engine_are_refused_in_one_line() -> None:
    pytest.importorskip("rlcore.algorithms.grpo.config").AsyncGRPOConfig.model_fields.get(
        "in_flight_weight_updates"
    ) or pytest.skip("grpo.async_grpo.in_flight_weight_updates is not in rlcore yet")
    in_flight = [
        "grpo.async_grpo.enabled=true",
        "grpo.async_grpo.in_flight_weight_updates=true",
        "policy.generation.colocated={enabled: false, resources: {workers_per_node: 1}}",
        "loss.use_importance_sampling_correction=true",
    ]
    line = check_in_flight_updates(resolved(*in_flight))
    assert line is not None and line.status == "fail" and "\n" not in line.message
    assert line.message.startswith(
        "grpo.async_grpo.in_flight_weight_updates: true needs policy.generation.vllm_cfg.async_engine: true"
    )
    assert check_in_flight_updates(resolved(*in_flight, "policy.generation.vllm_cfg.async_engine=true")) is None
    assert check_in_flight_updates(resolved()) is None


def test_the_endpoint_without_the_async_engine_is_refused_naming_the_setting_that_serves_it() -> None:
    line = check_http_server(resolved("policy.generation.expose_http_server=true"))
    assert line is not None and line.status == "fail" and "\n" not in line.message
    assert line.message.startswith(
        "policy.generation.expose_http_server: is true, which needs policy.generation.vllm_cfg.async_engine: true"
    )
    served = ["policy.generation.expose_http_server=true", "policy.generation.vllm_cfg.async_engine=true"]
    assert check_http_server(resolved(*served)) is None
    assert check_http_server(resolved()) is None  # nothing served


def test_a_tensor_parallel_async_engine_is_accepted() -> None:
    """Its ranks' engine loops run in lock step (rl_vllm.lockstep; served in test_async_engine_tp.py)."""
    section = VllmConfig(async_engine=True, tensor_parallel_size=2)
    assert section.async_engine and section.tensor_parallel_size == 2


class RecordingGroup:
    """Stands in for the engines' worker group: records which engine each call went to."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []  # (engine rank, rows)
        self.call_ids: list[str] = []

    def run_on_worker(self, rank: int, method: str, batch: Any, **kwargs: Any) -> Calls:
        self.calls.append((rank, int(batch["input_ids"].shape[0])))
        self.call_ids.append(kwargs["call_id"])
        return Calls([len(self.calls)], [rank])

    def get_results(self, handle: Any) -> list[Any]:
        return []


def routed_engine(tp: int = 1) -> Any:
    from rl_vllm.generation import VllmGeneration
    from rl_vllm.sampling import SAMPLING_FIELDS
    from rlcore.distributed import NamedSharding

    engine: Any = object.__new__(VllmGeneration)  # a stand-in group replaces its worker group
    engine.cfg = SimpleNamespace(**dict.fromkeys(SAMPLING_FIELDS))
    engine.vllm_cfg = VllmConfig(async_engine=True, tensor_parallel_size=tp)
    engine.sharding = NamedSharding(dp=2, tp=tp)
    engine.engine_info = [{"max_model_len": 128}] * 2
    engine._refit_unchecked = False
    engine._outstanding, engine._routed, engine._routing = [0, 0], {}, threading.Lock()
    engine.worker_group = RecordingGroup()
    return engine


def group(prompt: list[int], rows: int) -> Any:
    from rlcore.data import BatchedDataDict

    return BatchedDataDict(
        input_ids=torch.tensor([prompt] * rows), input_lengths=torch.full((rows,), len(prompt), dtype=torch.long)
    )


def test_a_sample_group_goes_whole_to_the_engine_with_the_fewest_rows_outstanding() -> None:
    engine = routed_engine()
    first = engine.generate_async(group([1, 5, 6], 4))
    engine.generate_async(group([1, 7], 2))
    engine.generate_async(group([1, 8], 3))  # engine 1 has 2 rows outstanding, engine 0 has 4
    assert engine.worker_group.calls == [(0, 4), (1, 2), (1, 3)]
    engine.collect(first)
    engine.generate_async(group([1, 9], 1))  # engine 0 is free again
    assert engine.worker_group.calls[-1] == (0, 1)
    assert engine._outstanding == [1, 5]  # second and third still outstanding on engine 1


def test_a_sample_group_goes_to_every_rank_of_a_tensor_parallel_engine_and_rank_0_answers() -> None:
    """The ranks of one engine (tensor_parallel_size 2) get the same call, with the same call id (their
    requests' keys); only tensor-parallel rank 0's result is returned."""
    engine = routed_engine(tp=2)
    engine.generate_async(group([1, 5, 6], 4))
    second = engine.generate_async(group([1, 7], 2))
    group_calls = engine.worker_group.calls
    assert group_calls == [(0, 4), (1, 4), (2, 2), (3, 2)]  # engine 1 is ranks 2 and 3
    assert second.ranks == [2, 3] and second.output_ranks == [2] and len(second.refs) == 2
    ids = engine.worker_group.call_ids
    assert ids[0] == ids[1] and ids[2] == ids[3] and ids[0] != ids[2]
    assert engine._outstanding == [4, 2]
    engine.collect(second)
    assert engine._outstanding == [4, 0]
