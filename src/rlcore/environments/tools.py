"""The ``tools`` environment: the model calls tools over several turns, then answers; the answer is graded as math.

Each turn reads the latest assistant message with the configured tool-call parser (``env.tools_cfg.parser``):

- with no tool call (and nothing that tried to be one), it is the final answer: graded against the sample's
  ``ground_truth`` by the math environment's graders (``verifier``), and the episode ends;
- otherwise each call is checked (a known tool, arguments that fit its schema) and run in the sandbox
  (:mod:`rlcore.tools.sandbox`), at most ``max_tool_calls_per_turn`` of them, and the results go back as ``tool``
  messages (the observation's ``messages``, one per call: ``{"role": "tool", "content", "tool_call_id", "name"}``);
  reward 0, the episode goes on. A malformed call, an unknown tool, arguments that do not fit, or a call past the
  per-turn limit is answered with an error message the model sees, and flags the turn
  (``EnvironmentReturn.invalid_tool_calls``; ``grpo.invalid_tool_call_advantage`` reads it). A call that runs
  and fails (its exception) is answered with the error too, but is a valid call;
- a call stopped by a limit (wall time, CPU time, memory: a tool that loops or allocates without end) fails the
  sample with ``env.tools_cfg.on_limit: fail_sample`` (the default): the episode ends, reward 0, and the reason is
  the sample's error (printed to the run's log, counted in ``env/errors``); with ``answer`` it is answered like
  any failed call.

An episode that runs out of ``grpo.max_rollout_turns`` while still calling tools is never graded: its reward is 0.
The environment declares its tools' schemas as ``tools`` (OpenAI function tools), which the run passes to the chat
template of the first prompt. Per turn it reports ``tool_calls`` (calls tried, malformed ones included),
``invalid_tool_calls`` and ``tool_errors`` (valid calls that failed) per sample as ``metrics``.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rlcore.environments.scoring import last_completion
from rlcore.environments.tools_config import BUILTIN_TOOLS, ToolsConfig
from rlcore.interfaces.environment import EnvironmentReturn, Message

if TYPE_CHECKING:
    from rlcore.chat.tool_calls import ParsedToolCalls, ToolCall
    from rlcore.tools.sandbox import SandboxLimits, ToolResult


@dataclass
class _Turn:
    """One sample's tool turn: the answer messages (filled in order) and its counts."""

    messages: list[Message] = field(default_factory=list)
    calls: int = 0
    invalid: int = 0
    errors: int = 0
    stopped: str | None = None  # the first call a limit stopped: why


class ToolsEnvironment:
    """Runs the model's tool calls in a sandbox and grades its final answer (see the module)."""

    def __init__(self, config: ToolsConfig) -> None:
        from rlcore.chat.tool_calls import get_tool_call_parser
        from rlcore.environments.math_env import MathConfig, MathEnvironment
        from rlcore.tools.sandbox import SandboxLimits, network_namespace_available

        if config.isolate_network == "namespace" and not network_namespace_available():
            raise ValueError(
                "env.tools_cfg.isolate_network: namespace, but 'unshare -rn' does not work on this machine "
                "(unprivileged user namespaces are off, or util-linux's unshare is missing); set it to auto to fall "
                "back to the Python-level block (docs/tools.md)"
            )
        self.config = config
        self.targets: dict[str, str] = {}  # tool name -> "module:function"
        self.schemas: dict[str, dict[str, Any]] = {}
        for i, entry in enumerate(config.tools):
            name, target, schema = _tool(entry, i)
            if name in self.targets:
                raise ValueError(
                    f"env.tools_cfg.tools[{i}]: {entry!r} is named '{name}', like {self.targets[name]!r}; "
                    "the model calls tools by name, so each needs its own"
                )
            self.targets[name], self.schemas[name] = target, schema
        #: The tools' OpenAI function schemas, which the run gives the chat template of the first prompt.
        self.tools: list[dict[str, Any]] = list(self.schemas.values())
        self.parser = get_tool_call_parser(config.parser)
        self.grader = MathEnvironment(MathConfig(verifier=config.verifier))
        self.limits: SandboxLimits = SandboxLimits(
            timeout_s=config.timeout_s,
            memory_mb=config.memory_mb,
            cpu_s=config.cpu_s,
            max_output_chars=config.max_output_chars,
            isolate_network=config.isolate_network,
        )
        self.parallel = config.max_parallel_calls or os.cpu_count() or 1

    def step(self, message_logs: list[list[Message]], metadata: list[dict[str, Any]]) -> EnvironmentReturn:
        n = len(message_logs)
        parsed = [self.parser.parse(last_completion(log)) for log in message_logs]
        answering = [i for i, p in enumerate(parsed) if not p.calls and not p.invalid]
        turns = {i: self._checked_turn(p) for i, p in enumerate(parsed) if p.calls or p.invalid}
        self._run_calls(turns, parsed)

        graded = (
            self.grader.step([message_logs[i] for i in answering], [metadata[i] for i in answering])
            if answering
            else None
        )
        rewards = [0.0] * n
        answers: list[str | None] = [None] * n
        errors: list[str | None] = [None] * n
        observations: list[Message] = [{"role": "environment", "content": ""} for _ in range(n)]
        next_metadata: list[dict[str, Any] | None] = list(metadata)
        for row, i in enumerate(answering):
            assert graded is not None
            rewards[i], answers[i], errors[i] = graded.rewards[row], graded.answers[row], graded.errors[row]
            next_metadata[i] = None
        failing = {i for i, turn in turns.items() if turn.stopped and self.config.on_limit == "fail_sample"}
        for i, turn in turns.items():
            if i in failing:
                errors[i], next_metadata[i] = turn.stopped, None
            else:
                observations[i] = {"role": "tool", "content": "", "messages": turn.messages}
        return EnvironmentReturn(
            observations,
            next_metadata,
            rewards,
            [i not in turns or i in failing for i in range(n)],
            answers=answers,
            errors=errors,
            invalid_tool_calls=[i in turns and turns[i].invalid > 0 for i in range(n)],
            metrics={
                "tool_calls": [float(turns[i].calls) if i in turns else 0.0 for i in range(n)],
                "invalid_tool_calls": [float(turns[i].invalid) if i in turns else 0.0 for i in range(n)],
                "tool_errors": [float(turns[i].errors) if i in turns else 0.0 for i in range(n)],
            },
        )

    def _checked_turn(self, parsed: ParsedToolCalls) -> _Turn:
        """The turn's answers to what cannot run (malformed, unknown, bad arguments, past the limit); a
        placeholder for each call that runs, filled by :meth:`_run_calls`."""
        from rlcore.tools.schema import argument_problems

        turn = _Turn(calls=len(parsed.calls) + len(parsed.invalid))
        for k, reason in enumerate(parsed.invalid):
            turn.invalid += 1
            turn.messages.append(_answer(f"invalid_{k}", "invalid_tool_call", f"error: malformed tool call: {reason}"))
        limit = self.config.max_tool_calls_per_turn
        for k, call in enumerate(parsed.calls):
            problem = None
            if k >= limit:
                problem = f"not run: at most {limit} tool calls per turn"
            elif call.name not in self.schemas:
                problem = f"unknown tool '{call.name}' (the tools: {', '.join(self.schemas)})"
            elif problems := argument_problems(self.schemas[call.name], call.arguments):
                problem = "; ".join(problems)
            if problem is not None:
                turn.invalid += 1
            turn.messages.append(_answer(call.id, call.name, f"error: {problem}" if problem else None))
        return turn

    def _run_calls(self, turns: dict[int, _Turn], parsed: list[ParsedToolCalls]) -> None:
        """Run every call left to run (the placeholders, content None), up to ``max_parallel_calls`` at a time."""
        from rlcore.tools.sandbox import run_tool

        pending: list[tuple[_Turn, Message, ToolCall]] = []
        for i, turn in turns.items():
            by_id = {call.id: call for call in parsed[i].calls}
            pending += [(turn, m, by_id[m["tool_call_id"]]) for m in turn.messages if m["content"] is None]
        if not pending:
            return

        def call(job: tuple[_Turn, Message, ToolCall]) -> ToolResult:
            return run_tool(self.targets[job[2].name], job[2].arguments, self.limits)

        with ThreadPoolExecutor(max_workers=min(self.parallel, len(pending))) as pool:
            results = list(pool.map(call, pending))
        for (turn, message, job), result in zip(pending, results):
            message["content"] = result.output if result.ok else f"error: {result.error}"
            turn.errors += not result.ok
            if result.limit and turn.stopped is None:
                turn.stopped = f"tool '{job.name}' stopped by its {result.limit} limit: {result.error}"


def _answer(call_id: str, name: str, content: str | None) -> Message:
    return {"role": "tool", "content": content, "tool_call_id": call_id, "name": name}


def _tool(entry: str, index: int) -> tuple[str, str, dict[str, Any]]:
    """``(name, "module:function", schema)`` of ``env.tools_cfg.tools[index]``; an error naming it when its
    function cannot be imported or described."""
    from rlcore.plugins import import_object
    from rlcore.tools.schema import function_schema

    target = BUILTIN_TOOLS.get(entry, entry)
    where = f"env.tools_cfg.tools[{index}]"
    try:
        fn = import_object(target)
    except Exception as exc:  # noqa: BLE001 - reported with the config path that named it
        raise ValueError(f"{where}: cannot import {target!r}: {type(exc).__name__}: {exc}") from exc
    if not callable(fn):
        raise ValueError(f"{where}: {target!r} is a {type(fn).__name__}, not a function")
    try:
        schema = function_schema(fn, name=entry if entry in BUILTIN_TOOLS else None)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from exc
    return schema["function"]["name"], target, schema
