"""The hooks a plugin implements. Project name ``rlcore``; hooks are prefixed ``rlcore_``.

A plugin is any module or object with ``@hookimpl`` functions, published in the
``rlcore.plugins`` entry-point group. First-party backends use these same hooks.
A hook implementation declares only the arguments it uses (pluggy's rule), so a
hook can gain an argument without breaking an older plugin; new behaviour comes
as a new, optional hook.
"""

from __future__ import annotations

from collections.abc import Callable

import pluggy

from rlcore.plugins.algorithm_spec import AlgorithmSpec
from rlcore.plugins.environment_spec import EnvironmentSpec
from rlcore.plugins.spec import BackendSpec
from rlcore.plugins.tool_call_parser_spec import ToolCallParserSpec

hookspec = pluggy.HookspecMarker("rlcore")
hookimpl = pluggy.HookimplMarker("rlcore")


@hookspec
def rlcore_register_backends(register: Callable[[BackendSpec], None]) -> None:
    """Declare backends by calling ``register(BackendSpec(...))`` once per backend.

    Keep the module that implements this hook light: it is imported to list
    backends, so it must not import torch, ray or an engine. Heavy classes are
    named in the spec as ``"module:Class"`` strings and imported only inside
    the worker process that runs them.
    """


@hookspec
def rlcore_register_environments(register: Callable[[EnvironmentSpec], None]) -> None:
    """Declare environments by calling ``register(EnvironmentSpec(...))`` once per environment (since rlcore 0.2).

    The same rule as for backends: the module implementing this hook is light, and the environment's classes
    are named as ``"module:Class"`` strings.
    """


@hookspec
def rlcore_register_algorithms(register: Callable[[AlgorithmSpec], None]) -> None:
    """Declare training algorithms by calling ``register(AlgorithmSpec(...))`` once per algorithm.

    The same rule as for backends: the module implementing this hook is light, and the algorithm's classes
    are named as ``"module:Class"`` strings.
    """


@hookspec
def rlcore_register_tool_call_parsers(register: Callable[[ToolCallParserSpec], None]) -> None:
    """Declare tool-call parsers by calling ``register(ToolCallParserSpec(...))`` once per parser.

    A parser turns an assistant completion's text into the tool calls it makes
    (``rlcore.chat.tool_calls.ToolCallParser``); environments and the serving endpoint select one by name with
    ``rlcore.chat.tool_calls.get_tool_call_parser``. The same rule as for backends: the module implementing this
    hook is light, and the parser class is named as a ``"module:Class"`` string.
    """
