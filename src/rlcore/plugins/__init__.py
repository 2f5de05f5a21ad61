"""Plugin mechanism: hook specs, backend, environment and algorithm specs, capabilities, layouts, the keyword
arguments the core offers constructors, and the registry."""

from rlcore.plugins.algorithm_spec import AlgorithmSpec
from rlcore.plugins.capabilities import CAPABILITY_METHODS, Capability
from rlcore.plugins.environment_spec import EnvironmentSpec
from rlcore.plugins.hookspecs import hookimpl
from rlcore.plugins.layout import LayoutRequest, ParallelLayout
from rlcore.plugins.negotiation import GENERATION_DRIVER_KEYWORDS, TRAINING_WORKER_KEYWORDS, declared_kwargs
from rlcore.plugins.registry import BackendError, BackendRecord, Registry, get_registry, set_registry
from rlcore.plugins.spec import BackendSpec, import_object

__all__ = [
    "CAPABILITY_METHODS",
    "GENERATION_DRIVER_KEYWORDS",
    "TRAINING_WORKER_KEYWORDS",
    "AlgorithmSpec",
    "BackendError",
    "BackendRecord",
    "BackendSpec",
    "Capability",
    "EnvironmentSpec",
    "LayoutRequest",
    "ParallelLayout",
    "Registry",
    "declared_kwargs",
    "get_registry",
    "hookimpl",
    "import_object",
    "set_registry",
]
