"""``policy.warm_start``: a run that starts from the last checkpoint of another config's finished run.

The usual pipeline (SFT, then RL from its last checkpoint) as one config: ``rlcore run`` runs the warm start
first unless it has finished, then this run's model and tokenizer are that run's last checkpoint's
``weights/`` and ``tokenizer/``. "Finished" is the summary a completed run writes beside its checkpoints
(:data:`RUN_SUMMARY`), so a warm start that crashed is resumed, not taken half-trained.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlcore.config.errors import ConfigError

#: What ``rlcore run`` writes into ``logger.output_dir`` when a run completes (its summary line, as JSON).
RUN_SUMMARY = "summary.json"
WHERE = "policy.warm_start"


def warm_start_file(name: str) -> Path:
    """The config ``name`` names: a YAML file, else a shipped example's name."""
    from rlcore.examples import example_path

    if Path(name).is_file():
        return Path(name)
    try:
        return example_path(name)
    except KeyError as exc:
        raise ConfigError([f"{WHERE}: {name!r} is neither a config file nor an example ({exc.args[0]})"]) from None


def warm_start_output(name: str) -> Path:
    """Where the warm start's run writes (its ``logger.output_dir``)."""
    from rlcore.config.loader import load_config

    file = warm_start_file(name)
    try:
        return Path(load_config(file).logger.output_dir)
    except ConfigError as exc:
        raise ConfigError([f"{WHERE}: {name!r}: {problem}" for problem in exc.problems]) from None


def finished_checkpoint(output_dir: Path) -> Path | None:
    """The step checkpoint a finished run in ``output_dir`` ended with; None if it has not finished."""
    try:
        summary = json.loads((output_dir / RUN_SUMMARY).read_text())
    except (OSError, ValueError):
        return None
    weights = summary.get("final_weights") if isinstance(summary, dict) else None
    return Path(weights).parent if weights else None


def with_warm_start(cfg: Any, notices: list[str]) -> Any:
    """``cfg`` starting from its warm start's last checkpoint. Before the warm start has finished, ``cfg`` as
    it is, with a notice; training it is refused (:func:`unfinished_warm_start`)."""
    name = cfg.policy.warm_start
    if name is None:
        return cfg
    output = warm_start_output(name)
    checkpoint = finished_checkpoint(output)
    if checkpoint is None:
        line = _unfinished(name, output)
        notices.append(f"notice: {line}; rlcore run runs it first and starts from its last checkpoint")
        return cfg
    policy = cfg.policy
    updates: dict[str, Any] = {"warm_start": None, "model_name": str(checkpoint / "weights")}  # now applied
    if "name" not in policy.tokenizer.model_fields_set:
        updates["tokenizer"] = policy.tokenizer.model_copy(update={"name": str(checkpoint / "tokenizer")})
    return cfg.model_copy(update={"policy": policy.model_copy(update=updates)})


def unfinished_warm_start(cfg: Any) -> ConfigError | None:
    """Why ``cfg`` (resolved) cannot train yet: its warm start has not finished, so it has no starting model."""
    name = cfg.policy.warm_start
    if name is None:
        return None
    return ConfigError([f"{_unfinished(name, warm_start_output(name))}: rlcore run runs it first, or run it yourself"])


def _unfinished(name: str, output: Path) -> str:
    return f"{WHERE}: {name!r} has not finished (no {output / RUN_SUMMARY})"
