"""The plugin API versions this core serves, as data: what each one lets a spec say and what the core passes.

Everything a plugin sees belongs to a version: the hooks, the ``BackendSpec``
fields and capabilities, the arguments the core gives a training worker's and a
generation driver's constructor, and the worker methods it calls (the
Protocols of :mod:`rlcore.interfaces.workers`). A change to any of them is a
new version; the core keeps serving every version in
:data:`SUPPORTED_PLUGIN_API_VERSIONS`, so a plugin written for an older one
gets exactly the calls it was written for. ``docs/plugin-api.md`` is the
change log.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from rlcore.plugins.capabilities import Capability


@dataclass(frozen=True)
class PluginApi:
    """One version of the plugin API."""

    version: int
    #: Keyword arguments of ``Worker(config, tokenizer, **...)`` for a training backend's worker.
    training_worker_keywords: tuple[str, ...]
    #: Keyword arguments of ``Driver(cluster, generation_config, **...)`` for a generation backend's driver class.
    generation_driver_keywords: tuple[str, ...]
    #: ``BackendSpec`` fields a spec of this version may set.
    spec_fields: frozenset[str]
    #: Capabilities a spec of this version may declare.
    capabilities: frozenset[Capability]
    #: Kinds of backend a spec of this version may declare.
    kinds: frozenset[str] = frozenset({"training", "generation"})

    def training_worker_kwargs(self, available: Mapping[str, Any]) -> dict[str, Any]:
        """The keyword arguments of this version, taken from ``available`` (the core's full set)."""
        return {key: available[key] for key in self.training_worker_keywords}

    def generation_driver_kwargs(self, available: Mapping[str, Any]) -> dict[str, Any]:
        """The keyword arguments of this version present in ``available`` (``lora_rank`` only for adapter refit)."""
        return {key: available[key] for key in self.generation_driver_keywords if key in available}


_V1_SPEC_FIELDS = frozenset({"name", "kind", "worker_class", "driver_class", "config_class", "capabilities",
                             "requires", "install_hint", "plugin_api_version", "description"})
_V1_CAPABILITIES = frozenset({
    Capability.TRAIN, Capability.LOGPROBS, Capability.TOPK_LOGITS, Capability.REFERENCE_MODEL,
    Capability.DYNAMIC_BATCHING, Capability.SEQUENCE_PACKING, Capability.CHECKPOINT, Capability.TENSOR_PARALLEL,
    Capability.SEQUENCE_PARALLEL, Capability.PIPELINE_PARALLEL, Capability.REFIT, Capability.GENERATE,
    Capability.DATA_PARALLEL, Capability.STOP_STRINGS,
})

#: Version 1: the first published contract (rlcore 0.1.0 as of 2026-11-22).
API_1 = PluginApi(
    version=1,
    training_worker_keywords=("weights_path", "optimizer_path", "init_optimizer", "init_reference_model"),
    generation_driver_keywords=("tokenizer",),
    spec_fields=_V1_SPEC_FIELDS,
    capabilities=_V1_CAPABILITIES,
)

#: Version 2: workers get their validated section and the layout; specs may declare a layout function and a
#: config check; the LoRA, partial-refit and async-generation capabilities.
API_2 = PluginApi(
    version=2,
    training_worker_keywords=(*API_1.training_worker_keywords, "backend_config", "layout"),
    generation_driver_keywords=("tokenizer", "backend_config", "lora_rank"),
    spec_fields=_V1_SPEC_FIELDS | {"layout", "config_check"},
    capabilities=_V1_CAPABILITIES | {Capability.LORA, Capability.LORA_ADAPTER, Capability.PARTIAL_REFIT,
                                     Capability.ASYNC_GENERATION},
)

#: Version 3: the ``environment`` kind (:mod:`rlcore.interfaces.environment`); training and generation backends
#: get exactly what version 2 gives them.
API_3 = PluginApi(
    version=3,
    training_worker_keywords=API_2.training_worker_keywords,
    generation_driver_keywords=API_2.generation_driver_keywords,
    spec_fields=API_2.spec_fields,
    capabilities=API_2.capabilities,
    kinds=API_2.kinds | {"environment"},
)

#: Version 4: the ``chunked_logprobs`` capability: the worker honours ``policy.logprob_chunk_size`` (the core
#: refuses the setting for a backend without it); everything else as version 3.
API_4 = PluginApi(
    version=4,
    training_worker_keywords=API_3.training_worker_keywords,
    generation_driver_keywords=API_3.generation_driver_keywords,
    spec_fields=API_3.spec_fields,
    capabilities=API_3.capabilities | {Capability.CHUNKED_LOGPROBS},
    kinds=API_3.kinds,
)

#: Version 5: a loss may ask for more than token logprobs. The ``logits_at_indices`` capability: when a loss
#: declares the input (``LossFunction.inputs``), the worker puts the policy's logits at the token ids of
#: ``data['topk_indices']`` into each micro-batch before calling it (on-policy distillation). Environments may
#: return named reward components (``EnvironmentReturn.reward_components``, read by GDPO). Everything else as
#: version 4.
API_5 = PluginApi(
    version=5,
    training_worker_keywords=API_4.training_worker_keywords,
    generation_driver_keywords=API_4.generation_driver_keywords,
    spec_fields=API_4.spec_fields,
    capabilities=API_4.capabilities | {Capability.LOGITS_AT_INDICES},
    kinds=API_4.kinds,
)

PLUGIN_APIS: dict[int, PluginApi] = {api.version: api for api in (API_1, API_2, API_3, API_4, API_5)}
#: The version new plugins declare.
PLUGIN_API_VERSION = 5
#: Versions this core serves; a spec declaring another is listed as ``incompatible``.
SUPPORTED_PLUGIN_API_VERSIONS = frozenset(PLUGIN_APIS)
