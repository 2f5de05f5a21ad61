"""Generation (rollout) settings: sampling parameters and placement."""

from __future__ import annotations

from typing import Any

from pydantic import Field, PositiveInt, model_validator

from rlcore.config.base import SectionsModel, StrictModel

#: The generation engine of a config that names none; ``rlcore run`` falls back to a training backend that
#: generates itself when this one is not installed (:func:`rlcore.config.backends.self_generating`).
DEFAULT_GENERATION_BACKEND = "vllm"


class ColocationResources(StrictModel):
    """Dedicated resources for a generation backend that is not colocated."""

    num_nodes: PositiveInt = Field(1, description="Nodes reserved for generation.")
    workers_per_node: PositiveInt = Field(
        1, description="Generation workers per node (one per GPU in GPU mode, i.e. 'gpus_per_node')."
    )


class ColocationConfig(StrictModel):
    """Whether generation shares the training workers' resources.

    Also accepts a plain bool as shorthand: ``colocated: false`` is
    ``colocated: {enabled: false}``.
    """

    enabled: bool = Field(
        True,
        description="Run generation on the training workers' resources (weights refit by "
        "shared-memory streaming). False gives generation its own resources (refit by broadcast).",
    )
    resources: ColocationResources | None = Field(
        None, description="Resources for generation; required when enabled is false."
    )

    @model_validator(mode="before")
    @classmethod
    def _from_bool(cls, data: Any) -> Any:
        return {"enabled": data} if isinstance(data, bool) else data


def _or_bool(schema: dict[str, Any]) -> None:
    """JSON schema of ``colocated``: the section, or the bool shorthand."""
    section = {k: schema.pop(k) for k in list(schema) if k not in ("description", "title", "default")}
    schema["anyOf"] = [section, {"type": "boolean"}]


class GenerationConfig(SectionsModel):
    """Sampling parameters and placement of the generation backend.

    Backend-specific settings go in a ``<backend>_cfg`` sub-section (e.g.
    ``vllm_cfg``), collected into ``backend_sections``.
    """

    backend: str = Field(DEFAULT_GENERATION_BACKEND, description="Name of the generation backend plugin.")
    max_new_tokens: PositiveInt = Field(32, description="Maximum number of tokens generated per prompt.")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature (0 = greedy).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling threshold (1.0 = off).")
    top_k: PositiveInt | None = Field(None, description="Top-k sampling (None = off).")
    stop_token_ids: list[int] | None = Field(None, description="Token ids that end a completion.")
    stop_strings: list[str] | None = Field(None, description="Strings that end a completion.")
    model_name: str | None = Field(
        None, description="Model the engine loads; None (resolved at load) = policy.model_name."
    )
    pad_token_id: int | None = Field(None, description="Padding token id; None = taken from the tokenizer at run time.")
    colocated: ColocationConfig = Field(
        default_factory=ColocationConfig,
        description="Colocation with the training workers; a bool is shorthand for {enabled: <bool>}.",
        json_schema_extra=_or_bool,
    )
    verify_refit: bool | None = Field(
        None,
        description="After every refit, compare a fingerprint of what each engine holds with what the trainer "
        "sent, and stop in one line naming the tensor on a mismatch (docs/refit.md): null = where the "
        "generation backend declares verified_refit; true = required (refused where it does not); false = off.",
    )
    engine_restarts_per_step: int = Field(
        1,
        ge=0,
        le=100,
        description="Times one step restarts a generation engine that died (killed, out of memory) during "
        "generation or refit: on the same bundle, refit with the current weights, the lost rollouts redone; "
        "0 = the first death stops the run (docs/engine-faults.md).",
    )
    expose_http_server: bool = Field(
        False,
        description="Serve the policy on an OpenAI-compatible HTTP endpoint on 127.0.0.1 during rollouts, with the "
        "engines' current weights, and log its URL (NeMo-RL's vllm_cfg.expose_http_server; docs/agents.md). An "
        "agent environment serves it by itself. Needs a generation backend that serves requests continuously "
        "(rl-vllm: vllm_cfg.async_engine: true).",
    )
    tool_call_parser: str = Field(
        "hermes",
        description="The tool-call parser the endpoint reads an assistant completion's tool calls with (rlcore's "
        "'hermes': <tool_call>{...}</tool_call>, or one a plugin registers; NeMo-RL's "
        "http_server_serving_chat_kwargs.tool_parser).",
    )
