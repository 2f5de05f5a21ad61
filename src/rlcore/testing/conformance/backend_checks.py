"""What every backend kind's conformance class shares: the plugin module is light, the spec is valid, and
the worker class keeps the worker contract of :mod:`rlcore.interfaces.workers`."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from rlcore.interfaces.workers import CAPABILITY_PROTOCOLS, GenerationWorker, TrainingWorker, protocol_methods
from rlcore.testing.conformance.probes import (
    CLASSES_PROBE,
    PLUGIN_PROBE,
    plugin_reference,
    run_probe,
)

#: Modules that a plugin module (and a backend's config class, and a layout function) must not import.
HEAVY_MODULES = ("torch", "ray", "vllm", "megatron")

#: Methods every training worker class has: :class:`rlcore.interfaces.workers.TrainingWorker`.
TRAINING_WORKER_METHODS = tuple(protocol_methods(TrainingWorker))
#: Methods every generation worker class has: :class:`rlcore.interfaces.workers.GenerationWorker`.
GENERATION_WORKER_METHODS = tuple(protocol_methods(GenerationWorker))
#: Extra methods a declared capability requires (the Protocols of ``CAPABILITY_PROTOCOLS``).
CAPABILITY_METHODS = {c.value: tuple(protocol_methods(p)) for c, p in CAPABILITY_PROTOCOLS.items()}


def deep_merge(base: dict, extra: dict) -> dict:
    """``extra`` merged into ``base``, nested dicts merged key by key (a backend's config overrides)."""
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


class _BackendChecks:
    """Tests every backend kind shares: the plugin module is light and the spec is valid."""

    backend_name: ClassVar[str | None] = None
    #: A plugin (module or object with hook implementations) to register into an
    #: isolated registry when the backend is not installed through entry points.
    #: None: the backend is found through the installed ``rlcore.plugins`` entry
    #: point. An object other than a module is checked for lightness through the
    #: module that defines it, so keep it out of test modules that import torch.
    plugin: ClassVar[object | None] = None
    #: Modules the plugin module must not import (override only to add more).
    heavy_modules: ClassVar[tuple[str, ...]] = HEAVY_MODULES

    expected_kind: ClassVar[str] = ""
    required_worker_methods: ClassVar[tuple[str, ...]] = ()

    @pytest.fixture(scope="class", autouse=True)
    @classmethod
    def kit_registry(cls) -> Any:
        """The registry the class's policies resolve names in (isolated when ``plugin`` is set)."""
        from rlcore.plugins import Registry, get_registry
        from rlcore.testing.pytest_plugin import isolated_registry

        if cls.backend_name is None:
            pytest.skip(f"{cls.__name__} sets no backend_name")
        if cls.plugin is None:
            yield get_registry()
            return
        registry = Registry()
        registry.register_plugin(cls.plugin, name=f"conformance:{cls.backend_name}")
        with isolated_registry(registry):
            yield registry

    @pytest.fixture(scope="class")
    @classmethod
    def backend_spec(cls, kit_registry: Any) -> Any:
        """The backend's spec; the class skips when its engine is not installed."""
        record = kit_registry.find(cls.backend_name)
        if record.status == "unavailable":
            pytest.skip(f"backend '{cls.backend_name}' is unavailable: {record.problem}")
        return kit_registry.resolve(cls.backend_name)

    def test_plugin_module_is_light(self, kit_registry: Any) -> None:
        """Importing the plugin module and running its hook imports no heavy module (design.md §3)."""
        ref = plugin_reference(self.backend_name, self.plugin, kit_registry)
        out = run_probe(PLUGIN_PROBE, ref, ",".join(self.heavy_modules))
        assert not out["heavy"], (
            f"importing plugin {ref!r} and running its hook imported {out['heavy']}; "
            "import them inside the worker class's module instead"
        )
        names = {(r["name"], r["kind"]) for r in out["records"]}
        assert (self.backend_name, self.expected_kind) in names, (
            f"plugin {ref!r} registered {sorted(names)}, not {self.expected_kind} backend '{self.backend_name}'"
        )

    def test_spec_is_valid(self, backend_spec: Any) -> None:
        """Kind and name as declared; in a fresh interpreter, the config class, the layout function and the
        config check import lightly and the worker class keeps the worker contract (every method of its Protocols and of
        its declared capabilities, with signatures that take rlcore's calls, and a constructor that takes
        ``(config, tokenizer)`` and requires no keyword rlcore does not offer)."""
        from rlcore.plugins import BackendSpec

        assert backend_spec.name == self.backend_name
        assert backend_spec.kind == self.expected_kind, (
            f"backend '{self.backend_name}' declares kind {backend_spec.kind!r}, expected {self.expected_kind!r}"
        )
        assert BackendSpec.model_validate(backend_spec.model_dump()) == backend_spec
        out = run_probe(CLASSES_PROBE, backend_spec.model_dump_json(), ",".join(self.heavy_modules))
        assert out["config_error"] is None, f"config_class {backend_spec.config_class}: {out['config_error']}"
        assert out["layout_error"] is None, f"layout / config_check: {out['layout_error']}"
        assert not out["config_heavy"], (
            f"importing config_class {backend_spec.config_class}, layout "
            f"{backend_spec.layout} and config_check {backend_spec.config_check} "
            f"imported {out['config_heavy']}; they run on the driver and must stay "
            "light"
        )
        assert out["worker_error"] is None, f"worker_class {backend_spec.worker_class}: {out['worker_error']}"
        assert not out["problems"], (
            f"worker_class {backend_spec.worker_class} breaks the worker contract:\n" + "\n".join(out["problems"])
        )
