"""``env.verifiers_cfg``: which verifiers environment plays the samples, and what rlcore forwards to it.

Light: imports pydantic and rlcore's config base only. What needs verifiers (the environment's own config, its
seats, its task type) is checked when the environment is built (:mod:`rl_verifiers.environment`), with the same
dotted paths.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from rlcore.config.base import StrictModel


class VerifiersConfig(StrictModel):
    environment: str = Field(
        description="A verifiers taskset id (an installed top-level module exporting a verifiers.v1 Taskset, "
        "verifiers' env.taskset.id), or 'module:function' returning a verifiers.v1 Env."
    )
    args: dict[str, Any] = Field(
        default_factory=dict,
        description="For a taskset id: verifiers' env config (its [env] block: 'taskset' knobs, each seat's "
        "'harness', 'runtime', 'max_turns', 'timeout', an 'id' pairing an Env); for 'module:function': its keyword "
        "arguments. A seat may not set 'model', 'client' or 'sampling': every seat plays the policy through "
        "rlcore's endpoint.",
    )
    ground_truth_field: str | None = Field(
        "answer",
        description="The task-data field that receives a sample's metadata['ground_truth'] (null: not passed). "
        "Other metadata keys that are task-data fields pass under their own names.",
    )
    max_tokens: int | None = Field(
        None,
        gt=0,
        description="Each turn's token limit, sent with every request (the endpoint caps it at "
        "policy.generation.max_new_tokens); null: that limit.",
    )
    max_concurrent_episodes: int | None = Field(
        None,
        gt=0,
        description="How many episodes run at once (each runs verifiers' chat program as a subprocess); "
        "null: all of a rollout's episodes.",
    )

    @field_validator("environment")
    @classmethod
    def _names_something(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("name a verifiers taskset id (e.g. 'gsm8k') or 'module:function' returning a vf.Env")
        if ":" in v:
            module, _, function = v.partition(":")
            if not module or not function or ":" in function:
                raise ValueError(f"expected 'module:function', got {v!r}")
        return v

    @field_validator("ground_truth_field")
    @classmethod
    def _is_a_name(cls, v: str | None) -> str | None:
        if v is not None and not v.isidentifier():
            raise ValueError(f"expected a task-data field name, got {v!r}")
        return v

    @property
    def is_factory(self) -> bool:
        """Whether ``environment`` names a function that builds the Env (else a taskset id)."""
        return ":" in self.environment
