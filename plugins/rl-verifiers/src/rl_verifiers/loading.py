"""Building a verifiers Env from ``env.verifiers_cfg``, and refusing what would not train the policy.

A taskset id becomes verifiers' env config (``args`` merged under ``taskset.id``) with two defaults of rlcore's
for each seat ``args`` leaves unset: the ``subprocess`` runtime (verifiers' default is a remote sandbox, which
cannot reach rlcore's loopback endpoint) and, where the taskset bundles no harness of its own, the
``rl_verifiers_harness`` chat loop (verifiers' default, ``bash``, hands the model a shell on this machine and builds
its program with ``uv``). Every seat must play the policy through the endpoint: one that sets ``model``,
``client`` or ``sampling``, or runs on another runtime, is refused naming its dotted path.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import verifiers.v1 as vf

    from rl_verifiers.config import VerifiersConfig

SECTION = "env.verifiers_cfg"
HARNESS_ID = "rl_verifiers_harness"


def env_factory(config: VerifiersConfig) -> Callable[[], vf.Env]:
    """A function that builds a fresh Env for ``config`` (one per episode), checked once by building one now."""
    import verifiers.v1 as vf

    from rlcore.plugins import import_object

    if config.is_factory:
        function = import_object(config.environment)
        kwargs = dict(config.args)

        def build() -> vf.Env:
            env = function(**kwargs)
            if not isinstance(env, vf.Env):
                raise TypeError(
                    f"{SECTION}.environment: {config.environment} returned {type(env).__name__}, not a verifiers.v1 Env"
                )
            return env

    else:
        env_config = vf.resolve_env_config(_with_defaults(config.environment, config.args))

        def build() -> vf.Env:
            return vf.load_environment(env_config)

    check_seats(build(), config)
    return build


def _with_defaults(taskset_id: str, args: dict[str, Any]) -> dict[str, Any]:
    """verifiers' env config for ``taskset_id``: ``args`` with rlcore's runtime and harness defaults per seat."""
    import verifiers.v1 as vf

    raw = copy.deepcopy(args)
    taskset = raw.setdefault("taskset", {})
    if not isinstance(taskset, dict):
        raise ValueError(f"{SECTION}.args.taskset: expected a mapping of the taskset's knobs, got {taskset!r}")
    if taskset.get("id", taskset_id) != taskset_id:
        raise ValueError(
            f"{SECTION}.args.taskset.id: {taskset['id']!r} differs from {SECTION}.environment ({taskset_id!r}); "
            "name the taskset once, in environment"
        )
    taskset["id"] = taskset_id
    bundled = vf.default_harness_id(taskset_id) != "bash"
    config_type = vf.env_config_type(taskset_id, raw.get("id") or "")
    for name, field in config_type.model_fields.items():
        if not isinstance(field.default, vf.AgentConfig):
            continue
        seat = raw.setdefault(name, {})
        if not isinstance(seat, dict):
            raise ValueError(f"{SECTION}.args.{name}: expected a mapping (the seat's settings), got {seat!r}")
        seat.setdefault("runtime", {"type": "subprocess"})
        if field.default.harness is None and not bundled:
            seat.setdefault("harness", {"id": HARNESS_ID})
    return raw


def check_seats(env: vf.Env, config: VerifiersConfig) -> None:
    """Refuse a seat that would not play the policy through rlcore's endpoint (each problem a line)."""
    import verifiers.v1 as vf

    where = f"{SECTION}.args" if not config.is_factory else f"the Env {config.environment} returns: env"
    problems = []
    for name, seat in env.config:
        if not isinstance(seat, vf.AgentConfig):
            continue
        for field in ("model", "client", "sampling"):
            if getattr(seat, field) is not None:
                fix = f"set {SECTION}.max_tokens for the turn limit" if field == "sampling" else "leave it unset"
                problems.append(
                    f"{where}.{name}.{field}: every seat plays the policy through rlcore's endpoint (the run's "
                    f"model and policy.generation sampling); {fix}"
                )
        if seat.runtime.type != "subprocess":
            problems.append(
                f"{where}.{name}.runtime.type: {seat.runtime.type!r} cannot reach rlcore's endpoint, which listens "
                "on this machine's loopback; use 'subprocess' (rlcore's default)"
            )
    if problems:
        raise ValueError("\n".join(problems))


def task_data_fields(env: vf.Env) -> dict[str, Any]:
    """The fields of the Env's task data type (what a sample's metadata may fill)."""
    return dict(type(env.taskset).task_type().data_type().model_fields)
