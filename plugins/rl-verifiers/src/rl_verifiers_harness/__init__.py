"""The harness rl-verifiers gives a seat by default (verifiers harness id ``rl_verifiers_harness``).

verifiers' ``null`` harness (its chat loop: the model's turns, the task's MCP tools, no shell) run by the Python
that runs rlcore instead of a ``uv``-built environment: that Python already has everything the chat program
imports (verifiers depends on all of it), so nothing is downloaded and a machine without network can train. A
verifiers harness is a top-level module exporting one ``Harness`` subclass in ``__all__``, hence this package.
"""

from __future__ import annotations

import hashlib
import sys
from typing import TYPE_CHECKING, Any

from verifiers.v1.harnesses.null import NullHarness

if TYPE_CHECKING:
    from verifiers.v1.clients import ModelContext
    from verifiers.v1.runtimes import ProgramResult, Runtime
    from verifiers.v1.trace import Trace


class _RunsWithThisPython:
    """A runtime whose PEP 723 scripts run with ``sys.executable`` (their dependencies are installed here); every
    other call goes to the runtime it wraps."""

    def __init__(self, runtime: Runtime) -> None:
        self._runtime = runtime

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runtime, name)

    async def prepare_uv_script(
        self, script: str | bytes, env: dict[str, str] | None = None, *, activate: bool = True
    ) -> list[str]:
        data = script.encode() if isinstance(script, str) else script
        path = f"vf-chat-{hashlib.sha256(data).hexdigest()[:16]}.py"  # in the rollout's own workdir
        await self._runtime.write(path, data)
        return [sys.executable, path]


class LocalChatHarness(NullHarness):
    """verifiers' chat loop, run as a subprocess of this Python; only the subprocess runtime runs it."""

    async def setup(self, runtime: Runtime) -> None:
        if runtime.type != "subprocess":
            raise ValueError(
                f"harness rl_verifiers_harness runs on the subprocess runtime only, not {runtime.type!r}: "
                "rlcore's endpoint listens on this machine's loopback"
            )

    async def launch(
        self, ctx: ModelContext, trace: Trace, runtime: Runtime, *args: Any, **kwargs: Any
    ) -> ProgramResult:
        return await super().launch(ctx, trace, _RunsWithThisPython(runtime), *args, **kwargs)


__all__ = ["LocalChatHarness"]
