"""Plugin mechanism: hook specs, backend specs, capabilities, layouts, API versions and the registry."""

from rlcore.plugins.algorithm_spec import AlgorithmSpec
from rlcore.plugins.capabilities import Capability
from rlcore.plugins.hookspecs import hookimpl
from rlcore.plugins.layout import LayoutRequest, ParallelLayout
from rlcore.plugins.registry import BackendError, BackendRecord, Registry, get_registry, set_registry
from rlcore.plugins.spec import BackendSpec, import_object
from rlcore.plugins.versions import PLUGIN_API_VERSION, SUPPORTED_PLUGIN_API_VERSIONS, PluginApi

__all__ = [
    "PLUGIN_API_VERSION",
    "SUPPORTED_PLUGIN_API_VERSIONS",
    "AlgorithmSpec",
    "BackendError",
    "BackendRecord",
    "BackendSpec",
    "Capability",
    "LayoutRequest",
    "ParallelLayout",
    "PluginApi",
    "Registry",
    "get_registry",
    "hookimpl",
    "import_object",
    "set_registry",
]
