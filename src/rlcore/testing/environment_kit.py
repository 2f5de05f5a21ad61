"""The conformance kit of the environment kind: what the core relies on, checked on a few samples.

``check_environment(environment, config, cases)`` returns one line per
problem ([] = conforms). ``environment`` is what a plugin registered: an
``EnvironmentSpec``, or the name of an installed environment (``"math"``), or
just its class as ``"my_pkg.env:MyEnv"``. ``config`` is its settings: the
validated model, or a dict validated with the spec's ``config_class`` (None:
its defaults). ``cases`` are ``(completion, metadata)`` pairs a correct
environment can score. The core relies on these properties:

- its config class refuses unknown keys (``extra="forbid"``), so a typo is an
  error rather than a setting left at its default;
- it builds as ``Class(config)`` and ``step`` returns an ``EnvironmentReturn``
  with one entry per sample and finite rewards;
- a sample's result depends on that sample only: the same reward whatever its
  batch, its position in it, or how often it was scored (the core splits
  batches over actors and re-scores samples one by one after a crash);
- it does not change the message logs or metadata it is given (the loop keeps
  using them);
- an empty completion is scored, not raised on.
"""

from __future__ import annotations

import copy
import math
from typing import Any


def _logs(cases: list[tuple[str, dict[str, Any]]]) -> tuple[list[list[dict[str, str]]], list[dict[str, Any]]]:
    logs = [
        [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": completion}]
        for i, (completion, _) in enumerate(cases)
    ]
    return logs, [dict(meta) for _, meta in cases]


def _class_and_config(environment: Any, config: Any) -> tuple[str, Any]:
    """The environment's 'module:Class' and its config, from a spec, a registered name or a class path."""
    from rlcore.config.unknown_keys import ignores_unknown_keys
    from rlcore.plugins import EnvironmentSpec, get_registry

    if isinstance(environment, str) and ":" in environment:
        return environment, config
    spec = environment if isinstance(environment, EnvironmentSpec) else get_registry().resolve_environment(environment)
    model = spec.load_config_class()
    if model is not None and ignores_unknown_keys(model):
        raise TypeError(
            f"config class {spec.config_class} ignores unknown keys, so a user's typo would leave a "
            "setting at its default: set model_config = ConfigDict(extra='forbid')"
        )
    if model is not None and (config is None or isinstance(config, dict)):
        config = model(**(config or {}))
    return spec.environment_class, config


def check_environment(environment: Any, config: Any, cases: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """Problems of ``environment`` (an ``EnvironmentSpec``, an installed environment's name or 'module:Class')
    built with ``config``, on ``cases``."""
    from rlcore.environments.runner import build_environment
    from rlcore.interfaces.environment import EnvironmentReturn

    if len(cases) < 2:
        return ["check_environment needs at least two cases"]
    try:
        env_class, config = _class_and_config(environment, config)
    except Exception as exc:  # noqa: BLE001 - an unusable spec or config is the problem
        return [f"{environment!r}: {type(exc).__name__}: {' '.join(str(exc).split())}"]
    try:
        env = build_environment(env_class, config)
    except Exception as exc:  # noqa: BLE001 - reported as the problem
        return [f"{env_class}({config!r}) raised {type(exc).__name__}: {exc}"]

    def rewards(batch: list[tuple[str, dict[str, Any]]]) -> list[float]:
        logs, metadata = _logs(batch)
        result = env.step(logs, metadata)
        if not isinstance(result, EnvironmentReturn):
            raise TypeError(f"step returned {type(result).__name__}, not an EnvironmentReturn")
        if len(result.rewards) != len(batch):
            raise ValueError(f"step returned {len(result.rewards)} rewards for {len(batch)} samples")
        return result.rewards

    problems = []
    try:
        whole = rewards(cases)
        if not all(math.isfinite(r) for r in whole):
            problems.append(f"rewards must be finite numbers, got {whole}")
        if rewards(cases) != whole:
            problems.append("scoring the same batch twice gave different rewards")
        if rewards(cases[::-1]) != whole[::-1]:
            problems.append("a sample's reward depends on its position in the batch")
        alone = [rewards([case])[0] for case in cases]
        if alone != whole:
            problems.append(f"rewards of samples scored one by one {alone} differ from the batch's {whole}")
        logs, metadata = _logs(cases)
        before = copy.deepcopy((logs, metadata))
        env.step(logs, metadata)
        if (logs, metadata) != before:
            problems.append("step changed the message logs or metadata it was given")
        rewards([("", cases[0][1]), cases[1]])
    except Exception as exc:  # noqa: BLE001 - the contract's failures, one line each
        problems.append(f"step raised {type(exc).__name__}: {exc}")
    return problems


__all__ = ["check_environment"]
