"""The ``tools`` environment's section, ``env.tools_cfg`` (light: imports no tool)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveInt, field_validator

from rlcore.config.base import StrictModel

#: Tools rlcore ships, by the name a config gives them: ``"module:function"`` of each.
BUILTIN_TOOLS: dict[str, str] = {"calculator": "rlcore.tools.calculator:calculator"}


class ToolsConfig(StrictModel):
    tools: list[str] = Field(
        min_length=1,
        description="The tools the model may call: each a built-in name (calculator: arithmetic on numbers) or "
        "'module:function' of a Python function, called with the call's JSON arguments as keywords; the model is "
        "shown its OpenAI function schema, derived from the signature's type hints and the docstring. Every call "
        "runs in a sandboxed child process (docs/tools.md).",
    )
    parser: str = Field(
        "hermes",
        description="The tool-call parser that reads the calls from a completion (hermes: "
        '<tool_call>{"name": ..., "arguments": {...}}</tool_call>, as Qwen2.5 and Hermes write them); plugins add '
        "parsers with a ToolCallParserSpec.",
    )
    timeout_s: float = Field(10.0, gt=0, description="Wall time of one call; past it the call's processes are killed.")
    cpu_s: float | None = Field(
        None, gt=0, description="CPU time of one call (RLIMIT_CPU, whole seconds rounded up); None: timeout_s."
    )
    memory_mb: int = Field(
        1024, ge=32, description="Address space of one call's process (RLIMIT_AS); beyond it allocations fail."
    )
    on_limit: Literal["fail_sample", "answer"] = Field(
        "fail_sample",
        description="A call stopped by a limit (timeout_s, cpu_s, memory_mb: a tool that loops or allocates without "
        "end). fail_sample: the episode ends with reward 0, the reason as its error (counted in env/errors, printed "
        "to the run's log); answer: the error goes back to the model like any failed call's.",
    )
    max_output_chars: PositiveInt = Field(
        4000, description="A call's result is cut to this many characters (plus a marker saying how many were cut)."
    )
    max_tool_calls_per_turn: PositiveInt = Field(
        4,
        description="The calls of one assistant turn that are run; further calls are answered with an error and "
        "flag the turn as an invalid tool call.",
    )
    max_parallel_calls: PositiveInt | None = Field(
        None, description="How many calls of a batch run at once (each a process); None: the machine's CPU count."
    )
    isolate_network: Literal["auto", "namespace", "python"] = Field(
        "auto",
        description="How a call is kept off the network. python: socket creation is blocked in the tool's "
        "interpreter (not in C extensions or programs it starts); namespace: also a network namespace of its own "
        "('unshare -rn'; refused where unprivileged user namespaces are off); auto: namespace where it works, "
        "else python.",
    )
    verifier: Literal["auto", "math_verify", "builtin", "dapo"] = Field(
        "auto",
        description="How the final answer (the first assistant turn without a tool call) is scored against "
        "ground_truth: the math environment's graders (env.math_cfg.verifier).",
    )

    @field_validator("tools")
    @classmethod
    def _named_tools(cls, tools: list[str]) -> list[str]:
        for i, entry in enumerate(tools):
            if entry not in BUILTIN_TOOLS and not _is_target(entry):
                raise ValueError(
                    f"entry {i}, {entry!r}, is neither a built-in tool ({', '.join(sorted(BUILTIN_TOOLS))}) nor "
                    "'module:function'"
                )
        if len(set(tools)) != len(tools):
            raise ValueError(f"names a tool twice: {tools}")
        return tools


def _is_target(entry: str) -> bool:
    module, sep, function = entry.partition(":")
    return bool(sep) and all(p.isidentifier() for p in module.split(".")) and function.isidentifier()
