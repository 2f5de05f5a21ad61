"""The plugin API keeps its word: versions, a closed set of capabilities, backend-declared layouts, and the
worker contract checked against the Protocols of ``rlcore.interfaces.workers``."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rlcore.config import ConfigError, load_config_dict, resolve
from rlcore.interfaces.workers import worker_problems
from rlcore.plugins import (
    SUPPORTED_PLUGIN_API_VERSIONS,
    BackendError,
    BackendSpec,
    Capability,
    LayoutRequest,
    ParallelLayout,
    Registry,
    get_registry,
    hookimpl,
)
from rlcore.plugins.versions import API_1, API_2, API_3, API_4, API_5


def registry_with(**spec) -> Registry:
    """A registry holding one plugin that registers ``BackendSpec(**spec)``."""

    class Plugin:
        @hookimpl
        def rlcore_register_backends(self, register):
            register(BackendSpec(**spec))

    registry = Registry()
    registry.register_plugin(Plugin(), name="third-party", distribution="third-party-dist")
    return registry


# -- versions and capabilities ----------------------------------------------------------------------------


def test_a_capability_typo_is_refused_at_registration_in_one_line():
    registry = registry_with(name="mine", kind="training", worker_class="collections:Counter",
                             capabilities={"train", "dynamic_batchng"}, plugin_api_version=2)
    (record,) = registry.records
    assert record.status == "broken"
    assert record.problem.startswith("plugin failed to load: BackendSpec refused: capabilities: unknown capability "
                                     "'dynamic_batchng' (did you mean 'dynamic_batching'?); known: train, logprobs")
    assert "\n" not in record.problem
    with pytest.raises(BackendError, match="is broken: plugin failed to load"):
        registry.resolve("third-party")


def test_the_core_tests_capabilities_by_member():
    spec = BackendSpec(name="mine", kind="training", worker_class="collections:Counter",
                       capabilities={Capability.TRAIN, "dynamic_batching"})
    assert spec.supports(Capability.DYNAMIC_BATCHING) and not spec.supports(Capability.SEQUENCE_PACKING)
    with pytest.raises(ValueError, match="'sequence_pakcing' is not a valid Capability"):
        spec.supports("sequence_pakcing")
    assert spec.model_dump(mode="json")["capabilities"] in (["train", "dynamic_batching"],
                                                            ["dynamic_batching", "train"])


@pytest.mark.parametrize("extra, what", [
    ({"capabilities": {"train", "lora"}}, "capability 'lora'"),
    ({"layout": "my_pkg.layout:parallel_layout"}, "layout"),
])
def test_a_version_1_spec_cannot_use_what_came_with_version_2(extra, what):
    with pytest.raises(ValidationError, match=f"{what} need plugin_api_version 2, but the spec declares 1"):
        BackendSpec(name="old", kind="training", worker_class="my_pkg.worker:W", **extra)  # version omitted: 1
    BackendSpec(name="new", kind="training", worker_class="my_pkg.worker:W", plugin_api_version=2, **extra)


def test_each_version_gets_exactly_its_own_constructor_arguments():
    assert SUPPORTED_PLUGIN_API_VERSIONS == {1, 2, 3, 4, 5}
    available = dict(weights_path=None, optimizer_path=None, init_optimizer=True, init_reference_model=True,
                     backend_config=object(), layout=ParallelLayout())
    assert set(API_1.training_worker_kwargs(available)) == {"weights_path", "optimizer_path", "init_optimizer",
                                                            "init_reference_model"}
    assert set(API_2.training_worker_kwargs(available)) == set(available)
    driver = {"tokenizer": object(), "backend_config": object()}
    assert set(API_1.generation_driver_kwargs(driver)) == {"tokenizer"}
    assert set(API_2.generation_driver_kwargs({**driver, "lora_rank": 8})) == {"tokenizer", "backend_config",
                                                                               "lora_rank"}
    # version 3 adds the environment kind; backends get what version 2 gives them
    assert API_3.training_worker_kwargs(available) == API_2.training_worker_kwargs(available)
    assert API_3.generation_driver_kwargs(driver) == API_2.generation_driver_kwargs(driver)
    assert API_3.kinds - API_2.kinds == {"environment"}
    # version 4 adds one capability and nothing else; no earlier version gains it
    assert API_4.capabilities - API_3.capabilities == {Capability.CHUNKED_LOGPROBS}
    assert API_3.capabilities == API_2.capabilities == set(Capability) - {Capability.CHUNKED_LOGPROBS,
                                                                           Capability.LOGITS_AT_INDICES}
    assert (API_4.training_worker_kwargs(available), API_4.kinds) == (API_3.training_worker_kwargs(available),
                                                                       API_3.kinds)
    # version 5 adds the loss-input capability and nothing else a backend is given
    assert API_5.capabilities - API_4.capabilities == {Capability.LOGITS_AT_INDICES}
    assert (API_5.training_worker_kwargs(available), API_5.generation_driver_kwargs(driver), API_5.kinds) == (
        API_4.training_worker_kwargs(available), API_4.generation_driver_kwargs(driver), API_4.kinds)


def test_a_version_4_spec_cannot_declare_logits_at_indices():
    spec = dict(name="v4", kind="training", worker_class="my_pkg.worker:W", capabilities={"train", "logits_at_indices"})
    with pytest.raises(ValidationError, match="capability 'logits_at_indices' need plugin_api_version 5, but the "
                                              "spec declares 4"):
        BackendSpec(**spec, plugin_api_version=4)
    BackendSpec(**spec, plugin_api_version=5)


def test_a_version_3_spec_cannot_declare_chunked_logprobs():
    spec = dict(name="v3", kind="training", worker_class="my_pkg.worker:W", capabilities={"train", "chunked_logprobs"})
    with pytest.raises(ValidationError, match="capability 'chunked_logprobs' need plugin_api_version 4, but the spec "
                                              "declares 3"):
        BackendSpec(**spec, plugin_api_version=3)
    BackendSpec(**spec, plugin_api_version=4)


# -- the worker contract ---------------------------------------------------------------------------------


def _worker(init, **methods) -> type:
    """A training worker class: the reference worker's methods, with ``__init__`` and ``methods`` replaced."""
    from rlcore.backends.reference.worker import ReferenceWorker

    return type("Candidate", (ReferenceWorker,), {"__init__": init, **methods})


def _v1_init(self, config, tokenizer=None, weights_path=None, optimizer_path=None, init_optimizer=True,
             init_reference_model=True):
    pass


def _v2_init(self, config, tokenizer=None, *, weights_path=None, optimizer_path=None, init_optimizer=True,
             init_reference_model=True, backend_config=None, layout=None):
    pass


V1 = BackendSpec(name="w", kind="training", worker_class="m:W", capabilities={"train", "refit"})
V2 = BackendSpec(name="w", kind="training", worker_class="m:W", capabilities={"train", "refit"},
                 plugin_api_version=2)


def test_a_worker_is_checked_against_its_versions_constructor():
    assert worker_problems(_worker(_v1_init), V1) == []
    assert worker_problems(_worker(_v2_init), V2) == []
    (problem,) = worker_problems(_worker(_v1_init), V2)  # the break of issue 25, found before Ray starts
    assert "Candidate.__init__" in problem and "backend_config=..." in problem
    assert "unexpected keyword argument 'backend_config'" in problem and "plugin API version 2" in problem
    (problem,) = worker_problems(_worker(_v2_init), V1)  # written for 2, declares (by omission) 1
    assert "takes backend_config, layout" in problem and "declare plugin_api_version=2" in problem


def test_a_worker_method_that_cannot_take_the_cores_call_is_named():
    def get_logprobs(self, data):  # no ``mode``: Policy passes mode=...
        pass

    problems = worker_problems(_worker(_v2_init, get_logprobs=get_logprobs, finish_training=None), V2)
    assert any(p.startswith("Candidate.get_logprobs(self, data) cannot take rlcore's call get_logprobs(data, "
                            "mode=...)") for p in problems), problems
    assert "Candidate.finish_training: missing (TrainingWorker of rlcore.interfaces.workers)" in problems
    # a capability adds its Protocol: 'topk_logits' needs get_topk_logits(data, k=..., ...)
    topk = V2.model_copy(update={"capabilities": V2.capabilities | {Capability.TOPK_LOGITS}})
    assert worker_problems(_worker(_v2_init), topk) == []
    assert any("get_topk_logits" in p for p in worker_problems(_worker(_v2_init, get_topk_logits=None), topk))


def test_every_installed_backends_worker_keeps_the_contract():
    checked = []
    for record in get_registry().records:
        if record.status != "ok" or record.spec.kind != "training":
            continue
        spec = record.spec
        assert worker_problems(spec.load_worker_class(), spec) == [], spec.name
        checked.append(spec.name)
    assert {"reference", "dtensor", "fsdp1", "megatron"} <= set(checked)


# -- layouts ----------------------------------------------------------------------------------------------


def shards_as_tp(request: LayoutRequest) -> ParallelLayout:
    """A third party's layout function: its own section's ``shards`` is its tensor-parallel degree."""
    if request.section.shards > 4:
        raise ValueError("policy.mine_cfg.shards: at most 4 shards; set it to 4 or less")
    return ParallelLayout(tp=request.section.shards, paths={"tp": "policy.mine_cfg.shards"})


def not_a_layout(request: LayoutRequest) -> dict:
    return {"tp": 2}


def mine(layout: str, registry: Registry) -> None:
    class Plugin:
        @hookimpl
        def rlcore_register_backends(self, register):
            register(BackendSpec(name="mine", kind="training", worker_class="collections:Counter",
                                 config_class="tests.fixtures.third_party_config:MineConfig", layout=layout,
                                 capabilities={"train", "tensor_parallel"}, plugin_api_version=2))

    registry.register_plugin(Plugin(), name="mine")


def test_a_third_party_layout_sets_the_data_parallel_size(rlcore_registry):
    mine(f"{__name__}:shards_as_tp", rlcore_registry)
    raw = {"cluster": {"workers_per_node": 4}, "policy": {"backend": "mine", "train_global_batch_size": 8}}
    assert resolve(load_config_dict(raw)).policy.data_parallel_size == 4  # shards 1 (the default)
    raw["policy"]["mine_cfg"] = {"shards": 2}
    policy = resolve(load_config_dict(raw)).policy
    assert (policy.layout.tp, policy.data_parallel_size, policy.batch.samples_per_rank) == (2, 2, 4)
    raw["policy"]["mine_cfg"] = {"shards": 3}
    with pytest.raises(ConfigError) as caught:
        resolve(load_config_dict(raw))
    assert caught.value.problems == ["policy.mine_cfg.shards: tp 3 does not divide the world size 4 "
                                     "(cluster.num_nodes × cluster.workers_per_node); choose sizes whose product "
                                     "divides 4, or a cluster of a multiple of 3 ranks"]
    raw["policy"]["mine_cfg"] = {"shards": 8}
    with pytest.raises(ConfigError) as caught:
        resolve(load_config_dict(raw))
    assert caught.value.problems == ["policy.mine_cfg.shards: at most 4 shards; set it to 4 or less"]


def test_a_layout_function_must_return_a_layout(rlcore_registry):
    mine(f"{__name__}:not_a_layout", rlcore_registry)
    with pytest.raises(ConfigError, match=r"returned dict, not a rlcore.plugins.ParallelLayout"):
        resolve(load_config_dict({"policy": {"backend": "mine"}}))


def refuses_odd_shards(request: LayoutRequest) -> list[str]:
    """A third party's config check: a setting outside its own section that it cannot run."""
    if request.policy.train_micro_batch_size > 1:
        return ["policy.train_micro_batch_size: mine runs one sample per micro-batch; set it to 1"]
    return []


def test_a_backend_checks_the_config_it_will_run(rlcore_registry):
    class Plugin:
        @hookimpl
        def rlcore_register_backends(self, register):
            register(BackendSpec(name="mine", kind="training", worker_class="collections:Counter",
                                 config_check=f"{__name__}:refuses_odd_shards", plugin_api_version=2))

    rlcore_registry.register_plugin(Plugin(), name="mine")
    assert resolve(load_config_dict({"policy": {"backend": "mine"}})).policy.spec.name == "mine"
    with pytest.raises(ConfigError) as caught:
        resolve(load_config_dict({"policy": {"backend": "mine", "train_micro_batch_size": 2}}))
    assert caught.value.problems == ["policy.train_micro_batch_size: mine runs one sample per micro-batch; set it "
                                     "to 1"]
    with pytest.raises(ValidationError, match="config_check need plugin_api_version 2"):
        BackendSpec(name="old", kind="training", worker_class="m:W", config_check=f"{__name__}:refuses_odd_shards")
