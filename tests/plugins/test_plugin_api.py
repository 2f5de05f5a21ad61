"""The plugin API keeps its word without versions: constructors get the keywords they declare, a closed set of
capabilities whose methods are checked (at registration when the worker's source shows it, in the kit and before
a worker is built otherwise), backend-declared layouts, and the worker contract checked against the Protocols of
``rlcore.interfaces.workers``."""

from __future__ import annotations

import pytest

from rlcore.config import ConfigError, load_config_dict, resolve
from rlcore.distributed.worker_host import WorkerHost
from rlcore.interfaces.workers import CAPABILITY_PROTOCOLS, capability_problems, protocol_methods, worker_problems
from rlcore.plugins import (
    CAPABILITY_METHODS,
    GENERATION_DRIVER_KEYWORDS,
    TRAINING_WORKER_KEYWORDS,
    BackendError,
    BackendSpec,
    Capability,
    LayoutRequest,
    ParallelLayout,
    Registry,
    declared_kwargs,
    get_registry,
    hookimpl,
)


def registry_with(**spec) -> Registry:
    """A registry holding one plugin that registers ``BackendSpec(**spec)``."""

    class Plugin:
        @hookimpl
        def rlcore_register_backends(self, register):
            register(BackendSpec(**spec))

    registry = Registry()
    registry.register_plugin(Plugin(), name="third-party", distribution="third-party-dist")
    return registry


# -- capabilities ----------------------------------------------------------------------------------------


def test_a_capability_typo_is_refused_at_registration_in_one_line():
    registry = registry_with(
        name="mine",
        kind="training",
        worker_class="collections:Counter",
        capabilities={"train", "dynamic_batchng"},
        plugin_api_version=2,
    )
    (record,) = registry.records
    assert record.status == "broken"
    assert record.problem.startswith(
        "plugin failed to load: BackendSpec refused: capabilities: unknown capability "
        "'dynamic_batchng' (did you mean 'dynamic_batching'?); known: train, logprobs"
    )
    assert "\n" not in record.problem
    with pytest.raises(BackendError, match="is broken: plugin failed to load"):
        registry.resolve("third-party")


def test_the_core_tests_capabilities_by_member():
    spec = BackendSpec(
        name="mine",
        kind="training",
        worker_class="collections:Counter",
        capabilities={Capability.TRAIN, "dynamic_batching"},
    )
    assert spec.supports(Capability.DYNAMIC_BATCHING) and not spec.supports(Capability.SEQUENCE_PACKING)
    with pytest.raises(ValueError, match="'sequence_pakcing' is not a valid Capability"):
        spec.supports("sequence_pakcing")
    assert spec.model_dump(mode="json")["capabilities"] in (
        ["train", "dynamic_batching"],
        ["dynamic_batching", "train"],
    )


def test_capability_methods_are_the_protocols_methods():
    """The light table the registry reads equals the Protocols the kit and the worker host check."""
    assert CAPABILITY_METHODS.keys() == CAPABILITY_PROTOCOLS.keys()
    for capability, protocol in CAPABILITY_PROTOCOLS.items():
        assert set(CAPABILITY_METHODS[capability]) == set(protocol_methods(protocol)), capability


@pytest.mark.parametrize("version", [None, 1, 2, 5, 99])
def test_plugin_api_version_is_accepted_and_means_nothing(version):
    """Whatever it says, a spec may use every field and capability, and is served like any other."""
    registry = registry_with(
        name="any",
        kind="training",
        worker_class="collections:Counter",
        layout="my_pkg.layout:parallel_layout",
        config_check="my_pkg.checks:check",
        capabilities={"train", "lora", "chunked_logprobs", "logits_at_indices"},
        plugin_api_version=version,
    )
    (record,) = registry.records
    assert (record.status, record.problem) == ("ok", "")
    assert record.as_dict()["plugin_api_version"] == version  # kept in 'rlcore backends list --json'


# -- what constructors are given: the keywords they declare ----------------------------------------------


class V1Worker:
    """A training worker written for rlcore 0.1 (no ``**kwargs``)."""

    def __init__(
        self,
        config,
        tokenizer=None,
        weights_path=None,
        optimizer_path=None,
        init_optimizer=True,
        init_reference_model=True,
    ):
        self.given = dict(
            weights_path=weights_path,
            optimizer_path=optimizer_path,
            init_optimizer=init_optimizer,
            init_reference_model=init_reference_model,
        )
        self.config, self.tokenizer = config, tokenizer


class V2Worker:
    """One written after ``backend_config`` and ``layout`` were added (keyword-only)."""

    def __init__(
        self,
        config,
        tokenizer=None,
        *,
        weights_path=None,
        optimizer_path=None,
        init_optimizer=True,
        init_reference_model=True,
        backend_config=None,
        layout=None,
    ):
        self.given = dict(
            weights_path=weights_path,
            optimizer_path=optimizer_path,
            init_optimizer=init_optimizer,
            init_reference_model=init_reference_model,
            backend_config=backend_config,
            layout=layout,
        )


class AnyWorker:
    def __init__(self, config, tokenizer, **kwargs):
        self.given = kwargs


OFFERED = dict(
    weights_path="/w",
    optimizer_path=None,
    init_optimizer=False,
    init_reference_model=True,
    backend_config=object(),
    layout=ParallelLayout(tp=2),
    model_head="value",
)
#: What a worker written for rlcore 0.2 declares: everything offered before model_head (0.3).
OFFERED_IN_0_2 = {k: v for k, v in OFFERED.items() if k != "model_head"}


def test_each_constructor_gets_exactly_the_keywords_it_declares():
    assert set(OFFERED) == set(TRAINING_WORKER_KEYWORDS)
    assert declared_kwargs(V1Worker, OFFERED) == {
        k: OFFERED[k] for k in ("weights_path", "optimizer_path", "init_optimizer", "init_reference_model")
    }
    assert declared_kwargs(V2Worker, OFFERED) == OFFERED_IN_0_2
    assert declared_kwargs(AnyWorker, OFFERED) == OFFERED
    assert declared_kwargs(len, OFFERED) == {}  # no signature to read: nothing beyond the positional call

    def old_driver(cluster, config, tokenizer=None):
        pass

    def new_driver(cluster, config, *, tokenizer=None, backend_config=None, lora_rank=None):
        pass

    driver = {"tokenizer": object(), "backend_config": object(), "lora_rank": 8}
    assert set(driver) == set(GENERATION_DRIVER_KEYWORDS)
    assert declared_kwargs(old_driver, driver) == {"tokenizer": driver["tokenizer"]}
    assert declared_kwargs(new_driver, driver) == driver


def test_the_worker_host_builds_a_worker_with_what_it_declares(monkeypatch):
    """Where the class is imported (the Ray worker process): an old and a new worker are both served."""
    monkeypatch.delenv("RLCORE_WORKER_LOG_DIR", raising=False)
    monkeypatch.delenv("RLCORE_CPU_THREADS", raising=False)
    old = WorkerHost(f"{__name__}:V1Worker", {}, ("cfg", "tok"), {}, offered=OFFERED, capabilities=("train",))
    assert (old.worker.config, old.worker.tokenizer) == ("cfg", "tok")
    assert old.worker.given == {k: OFFERED[k] for k in old.worker.given} and "layout" not in old.worker.given
    new = WorkerHost(f"{__name__}:V2Worker", {}, ("cfg", "tok"), {}, offered=OFFERED, capabilities=("train",))
    assert new.worker.given == OFFERED_IN_0_2


def test_the_worker_host_refuses_a_worker_without_a_capabilitys_method(monkeypatch):
    monkeypatch.delenv("RLCORE_WORKER_LOG_DIR", raising=False)
    with pytest.raises(TypeError) as caught:
        WorkerHost(
            f"{__name__}:V2Worker", {}, ("cfg", "tok"), {}, offered=OFFERED, capabilities=("train", "topk_logits")
        )
    assert str(caught.value) == (
        f"declares capability 'topk_logits', but {__name__}:V2Worker has no get_topk_logits (TopkLogitsWorker of "
        "rlcore.interfaces.workers): implement it or drop 'topk_logits' from its capabilities"
    )


# -- the worker contract ---------------------------------------------------------------------------------


def _worker(init, **methods) -> type:
    """A training worker class: the reference worker's methods, with ``__init__`` and ``methods`` replaced."""
    from rlcore.backends.reference.worker import ReferenceWorker

    return type("Candidate", (ReferenceWorker,), {"__init__": init, **methods})


W = BackendSpec(name="w", kind="training", worker_class="m:W", capabilities={"train", "refit"})


def test_a_worker_constructor_is_checked_against_what_the_core_offers():
    assert worker_problems(_worker(V1Worker.__init__), W) == []
    assert worker_problems(_worker(V2Worker.__init__), W) == []
    assert worker_problems(_worker(AnyWorker.__init__), W) == []

    def needs_more(self, config, tokenizer, *, weights_path=None, mesh, rank_map):
        pass

    assert worker_problems(_worker(needs_more), W) == [
        "Candidate.__init__ requires mesh, rank_map, which rlcore does not pass (it offers weights_path, "
        "optimizer_path, init_optimizer, init_reference_model, backend_config, layout, model_head): give them a "
        "default or take one of those"
    ]

    def no_tokenizer(self, config):
        pass

    (problem,) = worker_problems(_worker(no_tokenizer), W)
    assert problem.startswith(
        "Candidate.__init__(self, config) cannot take rlcore's call __init__(config, tokenizer, ...)"
    )


def test_a_worker_method_that_cannot_take_the_cores_call_is_named():
    def get_logprobs(self, data):  # no ``mode``: Policy passes mode=...
        pass

    problems = worker_problems(_worker(V2Worker.__init__, get_logprobs=get_logprobs, finish_training=None), W)
    assert any(
        p.startswith("Candidate.get_logprobs(self, data) cannot take rlcore's call get_logprobs(data, mode=...)")
        for p in problems
    ), problems
    assert "Candidate.finish_training: missing (TrainingWorker of rlcore.interfaces.workers)" in problems
    # a capability adds its Protocol: 'topk_logits' needs get_topk_logits(data, k=..., ...)
    topk = W.model_copy(update={"capabilities": W.capabilities | {Capability.TOPK_LOGITS}})
    assert worker_problems(_worker(V2Worker.__init__), topk) == []
    assert any("get_topk_logits" in p for p in worker_problems(_worker(V2Worker.__init__, get_topk_logits=None), topk))


class NoTopkWorker:
    """A worker whose whole method set is in this file: it has no ``get_topk_logits``."""

    def __init__(self, config, tokenizer=None):
        pass

    def get_logprobs(self, data, *, mode):
        pass


class InheritingNoTopkWorker(NoTopkWorker):
    pass


def test_a_declared_capability_without_its_method_is_refused_at_registration_in_one_line():
    registry = registry_with(
        name="liar",
        kind="training",
        worker_class=f"{__name__}:InheritingNoTopkWorker",
        capabilities={"train", "logprobs", "topk_logits"},
        plugin_api_version=5,
    )
    (record,) = registry.records
    assert (record.status, record.problem) == (
        "broken",
        (
            f"declares capability 'topk_logits', but {__name__}:InheritingNoTopkWorker has no get_topk_logits: "
            "implement it or drop 'topk_logits' from its capabilities"
        ),
    )
    with pytest.raises(BackendError, match="backend 'liar' is broken: declares capability 'topk_logits'"):
        registry.resolve("liar")
    # without the capability it is fine; a class whose bases live elsewhere waits for the kit and the worker host
    assert (
        registry_with(name="honest", kind="training", worker_class=f"{__name__}:NoTopkWorker", capabilities={"train"})
        .records[0]
        .status
        == "ok"
    )
    imported_base = registry_with(
        name="later", kind="training", worker_class=f"{__name__}:TopkLater", capabilities={"train", "topk_logits"}
    ).records[0]
    assert imported_base.status == "ok"
    assert capability_problems(TopkLater, {"train", "topk_logits"}) == [
        f"declares capability 'topk_logits', but {__name__}:TopkLater has no get_topk_logits (TopkLogitsWorker of "
        "rlcore.interfaces.workers): implement it or drop 'topk_logits' from its capabilities"
    ]


class TopkLater(WorkerHost):  # a base imported from another module: its source cannot tell
    pass


def test_every_installed_backends_worker_keeps_the_contract():
    checked = []
    for record in get_registry().backends():
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
            register(
                BackendSpec(
                    name="mine",
                    kind="training",
                    worker_class="collections:Counter",
                    config_class="tests.fixtures.third_party_config:MineConfig",
                    layout=layout,
                    capabilities={"train", "tensor_parallel"},
                    plugin_api_version=2,
                )
            )

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
    assert caught.value.problems == [
        "policy.mine_cfg.shards: tp 3 does not divide the world size 4 "
        "(cluster.num_nodes × cluster.workers_per_node); choose sizes whose product "
        "divides 4, or a cluster of a multiple of 3 ranks"
    ]
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
            register(
                BackendSpec(
                    name="mine",
                    kind="training",
                    worker_class="collections:Counter",
                    config_check=f"{__name__}:refuses_odd_shards",
                    plugin_api_version=2,
                )
            )

    rlcore_registry.register_plugin(Plugin(), name="mine")
    assert resolve(load_config_dict({"policy": {"backend": "mine"}})).policy.spec.name == "mine"
    with pytest.raises(ConfigError) as caught:
        resolve(load_config_dict({"policy": {"backend": "mine", "train_micro_batch_size": 2}}))
    assert caught.value.problems == ["policy.train_micro_batch_size: mine runs one sample per micro-batch; set it to 1"]
