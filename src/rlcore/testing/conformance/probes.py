"""The kit's subprocess probes: import a plugin or a spec's classes in a fresh interpreter and report.

A fresh interpreter, because the test process has long imported torch and the
rest: only there does "importing this pulls in no heavy module" mean anything.
:func:`plugin_reference` names the plugin module to probe.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from importlib import metadata
from typing import Any


def subprocess_env() -> dict[str, str]:
    """This process's environment with its sys.path as PYTHONPATH (test-local modules stay importable)."""
    paths = [p or os.getcwd() for p in sys.path]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def run_probe(script: str, *args: str) -> dict:
    """Run ``script`` in a fresh interpreter; it prints one JSON object as its last line."""
    proc = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, env=subprocess_env(), timeout=300
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise AssertionError(f"probe failed (exit {proc.returncode}):\n{proc.stderr.strip()[-3000:]}")
    return json.loads(lines[-1])


#: Imports a plugin, runs its hook in a fresh registry; prints the heavy modules loaded and the records.
PLUGIN_PROBE = r"""
import importlib, json, sys
ref, heavy_names = sys.argv[1], sys.argv[2].split(",")
module_name, _, attr = ref.partition(":")
obj = importlib.import_module(module_name)
for part in filter(None, attr.split(".")):
    obj = getattr(obj, part)
from rlcore.plugins import Registry
registry = Registry()
registry.register_plugin(obj, name="probe")
loaded = {name.split(".")[0] for name in sys.modules}
print(json.dumps({"heavy": sorted(loaded & set(heavy_names)),
                  "records": [r.as_dict() for r in registry.records]}))
"""

#: Imports a spec's config class, layout and config-check functions and worker class; prints import errors,
#: heavy modules, and
#: the worker contract's problems (rlcore.interfaces.workers.worker_problems).
CLASSES_PROBE = r"""
import json, sys
heavy_names = set(sys.argv[2].split(","))
from rlcore.plugins import BackendSpec, import_object
spec = BackendSpec.model_validate_json(sys.argv[1])
out = {"config_error": None, "layout_error": None, "config_heavy": [], "worker_error": None, "problems": []}
if spec.config_class:
    try:
        from pydantic import BaseModel
        cls = import_object(spec.config_class)
        if not (isinstance(cls, type) and issubclass(cls, BaseModel)):
            out["config_error"] = f"{spec.config_class} is not a pydantic model class"
        elif cls.model_config.get("extra") in (None, "ignore"):
            out["config_error"] = ("ignores unknown keys, so a user's typo would leave a setting at its "
                                   "default: set model_config = ConfigDict(extra='forbid')")
    except Exception as exc:
        out["config_error"] = f"{type(exc).__name__}: {exc}"
for function in filter(None, (spec.layout, spec.config_check)):
    try:
        if not callable(import_object(function)):
            out["layout_error"] = f"{function} is not callable"
    except Exception as exc:
        out["layout_error"] = f"{function}: {type(exc).__name__}: {exc}"
out["config_heavy"] = sorted({n.split(".")[0] for n in sys.modules} & heavy_names)
try:
    cls = import_object(spec.worker_class)
    if not isinstance(cls, type):
        out["worker_error"] = f"{spec.worker_class} is a {type(cls).__name__}, not a class"
    else:
        from rlcore.interfaces.workers import worker_problems
        out["problems"] = worker_problems(cls, spec)
except Exception as exc:
    out["worker_error"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""


def plugin_reference(backend_name: str, plugin: object | None, registry: Any) -> str:
    """``"module"`` or ``"module:attr"`` of the plugin that registers ``backend_name``.

    From the entry point when the backend is installed, else from the plugin
    object the test registered (a module, or an object found in its module).
    """
    if plugin is not None:
        if isinstance(plugin, types.ModuleType):
            return plugin.__name__
        module_name = getattr(plugin, "__module__", None) or type(plugin).__module__
        module = sys.modules.get(module_name)
        attr = next((k for k, v in vars(module).items() if v is plugin), None) if module else None
        return f"{module_name}:{attr}" if attr else module_name
    record = registry.find(backend_name)
    ep_name = record.plugin.partition(":")[2]
    for ep in metadata.entry_points(group="rlcore.plugins"):
        if ep.name == ep_name and ep.dist is not None and ep.dist.name == record.distribution:
            return ep.value
    raise AssertionError(f"no 'rlcore.plugins' entry point {record.plugin!r} registers backend {backend_name!r}")
