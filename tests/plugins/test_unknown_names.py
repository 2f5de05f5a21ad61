"""A name no installed plugin registers is answered with what is installed, a close name when there is one,
and a package only when it exists: rlcore's own plugin distributions. NeMo-RL's ``sglang`` and ``trtllm`` get
no invented ``pip install rl-sglang``, and ``trtllm`` is not taken for a typo of ``vllm``. No Ray."""

from __future__ import annotations

import re

import pytest

from rlcore.plugins import AlgorithmSpec, BackendError, BackendSpec, EnvironmentSpec, Registry, hookimpl


class Installed:
    """A plugin providing a generation backend named vllm, two environments and an algorithm."""

    @hookimpl
    def rlcore_register_backends(self, register):
        register(BackendSpec(name="vllm", kind="generation", worker_class="collections:Counter"))
        register(BackendSpec(name="dtensor", kind="training", worker_class="collections:Counter"))

    @hookimpl
    def rlcore_register_environments(self, register):
        register(EnvironmentSpec(name="math", environment_class="collections:Counter"))
        register(EnvironmentSpec(name="regex", environment_class="collections:Counter"))

    @hookimpl
    def rlcore_register_algorithms(self, register):
        register(AlgorithmSpec(name="dpo", config_class="collections:Counter", algorithm_class="collections:Counter"))


@pytest.fixture
def registry() -> Registry:
    registry = Registry()
    registry.register_plugin(Installed(), name="installed")
    return registry


def message(registry: Registry, name: str, kind: str | None = None) -> str:
    with pytest.raises(BackendError) as caught:
        registry.resolve(name, kind=kind)
    return str(caught.value)


@pytest.mark.parametrize(
    "name, install",
    [
        ("megatron", "pip install rl-megatron"),
        ("fsdp1", "pip install rl-fsdp1"),
        ("rl-fsdp1:fsdp1", "pip install rl-fsdp1"),
        ("vllm", "pip install 'rl-vllm[cpu]' (or 'rl-vllm[gpu]' on CUDA)"),
    ],
)
def test_a_first_party_backend_names_its_distribution(name, install):
    text = message(Registry(), name)  # nothing installed
    short = name.rpartition(":")[2]
    assert text == (
        f"no backend named '{name}' (installed: none); '{short}' comes with rlcore's rl-{short} distribution: "
        + install
    )


@pytest.mark.parametrize("name, what", [("sglang", "SGLang"), ("trtllm", "TensorRT-LLM")])
def test_an_engine_without_a_plugin_is_said_to_have_none(registry, name, what):
    text = message(registry, name, kind="generation")
    assert text == (
        f"no backend named '{name}' (installed: dtensor, vllm); '{name}' is {what}, a generation engine rlcore "
        "has no plugin for: choose an installed backend (rlcore backends list), or install a third-party plugin "
        "that provides it (docs/plugin-api.md says how one registers)"
    )
    assert "pip install" not in text and "did you mean" not in text


def test_an_unknown_backend_gets_a_close_name_or_where_to_look(registry):
    assert message(registry, "dtensr").endswith("; did you mean 'dtensor'?")
    text = message(registry, "mybackend")
    assert "pip install" not in text and "did you mean" not in text
    assert text.endswith(
        "no plugin rlcore knows of provides 'mybackend': choose an installed backend (rlcore backends list), "
        "or install or write the plugin that provides it (docs/plugin-api.md)"
    )


def test_an_unknown_environment_lists_the_installed_and_suggests_a_close_one(registry):
    assert registry.environments() and message(registry, "mathh", kind="environment") == (
        "no environment named 'mathh' (installed: math, regex); did you mean 'math'?"
    )
    text = message(registry, "word_count", kind="environment")
    assert text == (
        "no environment named 'word_count' (installed: math, regex); no plugin rlcore knows of provides "
        "'word_count': choose an installed environment (rlcore environments list), or install or write the plugin "
        "that provides it (docs/tasks.md)"
    )


def test_an_unknown_algorithm_lists_the_installed_and_suggests_a_close_one(registry):
    assert message(registry, "dpoo", kind="algorithm") == (
        "no algorithm named 'dpoo' (installed: dpo); did you mean 'dpo'?"
    )
    assert re.search(
        r"provides 'ppo': .*\(rlcore algorithms list\).*\(docs/algorithms\.md\)$",
        message(registry, "ppo", kind="algorithm"),
    )
