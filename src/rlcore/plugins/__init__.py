"""Plugin mechanism: hook specs, backend specs and the registry."""

from rlcore.plugins.hookspecs import hookimpl
from rlcore.plugins.registry import BackendError, BackendRecord, Registry, get_registry, set_registry
from rlcore.plugins.spec import PLUGIN_API_VERSION, BackendSpec, import_object

__all__ = [
    "PLUGIN_API_VERSION",
    "BackendError",
    "BackendRecord",
    "BackendSpec",
    "Registry",
    "get_registry",
    "hookimpl",
    "import_object",
    "set_registry",
]
