"""The value-model contract of rlcore 0.3: capability ``value_head``, the ``model_head`` worker keyword, the
``ValueWorker`` Protocol, and ``Policy`` refusing ``model_head="value"`` on a backend that does not declare it
before any process starts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rlcore.interfaces.workers import CAPABILITY_PROTOCOLS, ValueWorker, capability_problems, worker_problems
from rlcore.plugins import (
    CAPABILITY_METHODS,
    TRAINING_WORKER_KEYWORDS,
    BackendError,
    BackendSpec,
    Capability,
    declared_kwargs,
    get_registry,
)


class LanguageModelWorker:
    """A worker written before rlcore 0.3: it declares no model_head."""

    def __init__(self, config, tokenizer, *, weights_path=None, backend_config=None):
        pass


class ValueModelWorker:
    def __init__(self, config, tokenizer, *, weights_path=None, model_head="lm"):
        self.model_head = model_head

    def get_values(self, data, micro_batch_size=None, mode="plain"):
        return data


class ValueWorkerWithoutModes(ValueModelWorker):
    def get_values(self, data):  # cannot take rlcore's call get_values(data, micro_batch_size=..., mode=...)
        return data


def test_model_head_is_offered_from_0_3_and_only_to_who_declares_it():
    assert TRAINING_WORKER_KEYWORDS["model_head"] == "0.3"
    offered = {"weights_path": "/w", "backend_config": None, "model_head": "value"}
    assert "model_head" not in declared_kwargs(LanguageModelWorker, offered)
    assert declared_kwargs(ValueModelWorker, offered) == {"weights_path": "/w", "model_head": "value"}


def test_value_head_needs_get_values_with_rlcore_s_call():
    assert Capability("value_head") is Capability.VALUE_HEAD
    assert CAPABILITY_METHODS[Capability.VALUE_HEAD] == ("get_values",)
    assert CAPABILITY_PROTOCOLS[Capability.VALUE_HEAD] is ValueWorker
    (problem,) = capability_problems(LanguageModelWorker, {Capability.VALUE_HEAD})
    assert "declares capability 'value_head'" in problem and "has no get_values (ValueWorker" in problem
    spec = BackendSpec(
        name="v", kind="training", worker_class="x:ValueWorkerWithoutModes", capabilities={"train", "value_head"}
    )
    problems = worker_problems(ValueWorkerWithoutModes, spec)
    assert any("get_values" in p and "cannot take rlcore's call" in p for p in problems), problems
    assert not [p for p in worker_problems(ValueModelWorker, spec) if "get_values" in p]


def test_first_party_backends_declare_value_head_where_they_build_value_models():
    registry = get_registry()
    assert registry.resolve_backend("dtensor").supports(Capability.VALUE_HEAD)
    for name in ("reference", "fsdp1"):
        assert not registry.resolve_backend(name).supports(Capability.VALUE_HEAD), name


@pytest.mark.parametrize("backend", ["reference", "fsdp1"])
def test_policy_refuses_a_value_model_on_a_backend_without_value_head(backend, tiny_model_dir, monkeypatch):
    """One line naming the backend and the fix, before any worker group (no Ray: it would fail to start one)."""
    from rlcore.config import load_config_dict
    from rlcore.policy import Policy, lm_policy

    def no_worker_group(*args, **kwargs):
        raise AssertionError("a worker group was started for a refused value model")

    monkeypatch.setattr(lm_policy, "RayWorkerGroup", no_worker_group)
    config = load_config_dict(
        {"cluster": {"workers_per_node": 1}, "policy": {"backend": backend, "model_name": tiny_model_dir}}
    ).policy
    cluster = SimpleNamespace(world_size=1, use_gpus=False, bundle_ct_per_node_list=[1])
    with pytest.raises(BackendError) as refused:
        Policy(cluster, config, None, model_head="value")
    message = str(refused.value)
    assert "\n" not in message
    assert f"model_head='value': the '{backend}' training backend does not declare 'value_head'" in message
    assert "give the value model a backend that declares it" in message
    with pytest.raises(BackendError, match="model_head='critic': expected 'lm'"):
        Policy(cluster, config, None, model_head="critic")  # type: ignore[arg-type]
